"""One vLLM engine hosted by a Ray actor: placed by Ray, restarted by Ray.

The actor starts the engine as a child process group on its node (the same command line as dev
mode, ``launch/engines.py``), bound to the node's routable address, on ports it reserves on that
node. A watchdog thread ends the actor the moment the engine process exits, so Ray restarts the
actor (``max_restarts``) and with it a fresh engine; the proxy sees the engine's url change and
treats it as a new engine. An actor that dies outright takes its engine with it, engine core
included (``launch/reaper.py``).

Nothing here imports Ray at module level except through :func:`engine_host_class`, so the
module is importable (and unit-testable) without a cluster.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from launch.engine_hang import DEFAULT_TIMEOUT_S, HangDetector
from launch.engines import (
    EngineSpec,
    default_dtype,
    detect_device,
    is_loopback,
    private_socket_dir,
)
from launch.isolation import guard
from launch.models import model_config
from launch.processes import EngineProcess, start_engine, stop_engines
from launch.settings import EngineSettings
from transport.kv_size import kv_bytes_per_token_for_model

log = logging.getLogger(__name__)

PORT_RANGE = (21000, 29000)
#: How often the watchdog looks at its engine.
WATCH_TICK_S = 0.25


@dataclass(frozen=True)
class EngineTemplate:
    """What every engine of a deployment shares; the actor adds role, place and ports."""

    #: A built-in name ("tiny", "smollm2", built on each node), a path on every node, or a hub
    #: id (vLLM downloads it on each node).
    model: str
    served_model_name: str
    gpu_memory_utilization: float = 0.85  # one GPU per engine in Ray mode
    #: Engine logs on each engine's node; None: ``/tmp/pdserve-<uid>/logs`` (private).
    log_dir: str | None = None
    engines: EngineSettings = field(default_factory=EngineSettings)
    #: The address every engine binds: None = its node's cluster address; a local cluster
    #: (one machine) uses loopback.
    bind_host: str | None = None
    #: The deployment's secret (``launch/engine_guard.py``), set by ``pdserve ray``.
    api_key: str | None = field(default=None, repr=False)
    #: A ready engine whose /health goes unanswered this long (``launch/engine_hang.py``) is
    #: killed, so Ray restarts its actor; 0: never.
    hang_timeout_s: float = DEFAULT_TIMEOUT_S

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def node_lock_dir(name: str) -> Path:
    """``/tmp/pdserve-<uid>/<name>``: lock files only this user's processes on the node can
    make or plant links in (a shared ``/tmp`` directory let another user point a lock file at
    the engine user's files)."""
    path = private_socket_dir() / name
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def hold_lock(path: Path) -> int | None:
    """An exclusive lock on ``path`` (a file descriptor, held until closed or this process
    ends); None when another process holds it or ``path`` is a link (never followed)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


class PortReservation:
    """Ports held for this process's lifetime via per-port lock files on the node, so engine
    actors sharing a node never pick the same port (the locks vanish with the process)."""

    def __init__(self, host: str, count: int, port_range: tuple[int, int] = PORT_RANGE,
                 lock_dir: Path | None = None):
        lock_dir = lock_dir or node_lock_dir("ports")
        self._fds: list[int] = []
        self.ports: list[int] = []
        for port in range(*port_range):
            if len(self.ports) == count:
                break
            fd = hold_lock(lock_dir / f"{port}.lock")
            if fd is None:
                continue
            # A node address's engine publishes KV events on tcp://*:port (every interface):
            # a port held on any of them would fail it, so every port is checked there too.
            if not _bindable(host, port) or not (is_loopback(host)
                                                 or _bindable("0.0.0.0", port)):
                os.close(fd)
                continue
            self._fds.append(fd)
            self.ports.append(port)
        if len(self.ports) < count:
            self.release()
            raise RuntimeError(f"no {count} free ports in {port_range} on {host}")

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


class CoreReservation:
    """The CPU core an engine computes on, held for this process's lifetime by a lock file
    per (core, slot) on the node: the lowest free core first, so a node's engines spread over
    its cores whatever their roles, ordinals or placement; a core takes a second engine only
    once every core has one (slot 1 of every core before slot 2 of any). Ray's placement
    cannot do this: it counts logical CPUs and does not pin."""

    MAX_SLOTS = 64

    def __init__(self, cores: Sequence[int] | None = None, lock_dir: Path | None = None):
        cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
        lock_dir = lock_dir or node_lock_dir("cores")
        for slot in range(self.MAX_SLOTS):
            for core in cores:
                fd = hold_lock(lock_dir / f"{core}.{slot}.lock")
                if fd is not None:
                    self.core, self._fd = core, fd
                    return
        raise RuntimeError(f"no core to lock in {lock_dir}")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def interface_of(ip: str) -> str | None:
    """The network interface that holds ``ip`` (UCX must be told which one to use)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None


def engine_spec_for_node(template: EngineTemplate, role: str, node_ip: str, ports: list[int],
                         model_path: str, cpu_core: int | None = None) -> EngineSpec:
    """Pure: this engine's spec on this node (ports = [http, NIXL side channel, KV events];
    ``cpu_core``: the core it computes on, on a CPU node)."""
    device = detect_device()
    return EngineSpec(
        role=role,  # type: ignore[arg-type]
        model=model_path,
        served_model_name=template.served_model_name,
        port=ports[0],
        side_channel_port=ports[1],
        kv_events_port=ports[2],
        host=node_ip,
        device=device,
        # GPU: Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU.
        cpu_cores=str(cpu_core) if device == "cpu" and cpu_core is not None else None,
        kv_cache_gib=template.engines.kv_cache_gib,
        gpu_memory_utilization=template.gpu_memory_utilization,
        dtype=default_dtype(device, template.engines.dtype),
        max_model_len=template.engines.max_model_len,
        connector=template.engines.connector(cpu_fixes=device == "cpu"),
        extra_args=template.engines.vllm_args(),
        ucx_device=interface_of(node_ip),
        dev_endpoints=template.engines.engine_dev_endpoints,
        api_key=template.api_key,
    )


def model_kv_bytes_per_token(model: str, dtype: str) -> int | None:
    """KV bytes per token (KV cache dtype = the engine's) from the model's config on this
    node: a directory's, or a hub id's once its engine downloaded it; None until then."""
    config = model_config(model)
    if config is None:
        return None
    try:
        return kv_bytes_per_token_for_model(config.parent, dtype)
    except (KeyError, TypeError, ValueError) as exc:  # a shape it does not know
        log.warning("no KV size from %s: %r", config, exc)
        return None


class EngineHost:
    """The actor body (wrapped by :func:`engine_host_class`). One engine per actor."""

    def __init__(self, name: str, role: str, template: dict[str, Any]):
        import ray

        from launch.models import ensure_model, same_on_every_node

        t = EngineTemplate(**template)
        self.name = name
        self.role = role
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        # NIXL's handshake hashes the model's path: the same on every node, whatever its home.
        model_path = str(same_on_every_node(t.model, ensure_model(t.model),
                                            private_socket_dir() / "models"))
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        host = t.bind_host or self.node_ip
        self._ports = PortReservation(host, 3)
        self._core = CoreReservation() if detect_device() == "cpu" else None
        self.spec = engine_spec_for_node(t, role, host, self._ports.ports, model_path,
                                         self._core.core if self._core else None)
        self._model_path = model_path
        self.kv_bytes_per_token = model_kv_bytes_per_token(model_path, self.spec.dtype)
        log_dir = Path(t.log_dir) if t.log_dir else private_socket_dir() / "logs"
        self.proc: EngineProcess = start_engine(self.spec, log_dir / name,
                                                die_with_parent=True, own_session=True)
        self._stopping = threading.Event()
        self.failed: str | None = None
        self._hang = HangDetector(t.hang_timeout_s) if t.hang_timeout_s > 0 else None
        threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """End the actor when a working engine dies, so Ray restarts both. An engine that dies
        before it ever became ready is a configuration or resource error a restart would only
        repeat: it is reported (``info()["failed"]``) instead. A ready engine found hung is
        killed, and so ends the same way as one that died."""
        ready = False
        checked = 0.0
        while not self._stopping.wait(WATCH_TICK_S):
            if not ready:
                ready = self.proc.healthy()
            elif self._hang is not None:
                self._check_hang()
            if ready and time.monotonic() - checked > 10.0:  # threads that moved themselves
                checked = time.monotonic()
                guard([(self.name, self.proc.popen.pid, self.spec.cpu_cores)], log.warning)
            if self.proc.popen.poll() is None:
                continue
            self._kill_engine()  # whatever the server left behind (engine core, workers)
            if not ready:
                self.failed = (f"engine exited with {self.proc.popen.returncode} before it was "
                               f"ready: {self.proc.root_cause()!r} (log: {self.proc.log_path})")
                log.error("%s: %s", self.name, self.failed)
                return
            log.error("%s: engine exited with %s; exiting so Ray restarts this actor",
                      self.name, self.proc.popen.returncode)
            os._exit(1)

    def _check_hang(self) -> None:
        """Check the ready engine's /health when one is due; kill the engine once it is hung
        (its exit, a large process's takes a moment, then ends the actor)."""
        hang, now = self._hang, time.monotonic()
        assert hang is not None
        if hang.poll(self.proc.healthy, now):
            log.error("%s: engine alive (pid %d) but %s: killing it so Ray restarts this "
                      "actor", self.name, self.proc.popen.pid, hang.why(now))
            self._kill_engine()

    def _kill_engine(self) -> None:
        try:
            os.killpg(self.proc.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def info(self) -> dict[str, Any]:
        healthy = self.failed is None and self.proc.healthy()
        if healthy and self.kv_bytes_per_token is None:  # a hub id: vLLM has it locally now
            self.kv_bytes_per_token = model_kv_bytes_per_token(self._model_path,
                                                               self.spec.dtype)
        return {
            "name": self.name, "role": self.role, "url": self.spec.url,
            "kv_events": self.spec.kv_events_endpoint, "pid": self.proc.popen.pid,
            "node_ip": self.node_ip, "node_id": self.node_id, "device": self.spec.device,
            "dtype": self.spec.dtype,
            "cpu_cores": self.spec.cpu_cores,
            "kv_bytes_per_token": self.kv_bytes_per_token, "log": str(self.proc.log_path),
            "restarted": self.restarted, "failed": self.failed,
            "healthy": healthy,
        }

    def stop(self) -> None:
        """Stop the engine (graceful, then forced) and let the actor be killed."""
        self._stopping.set()
        stop_engines([self.proc])
        self._ports.release()
        if self._core is not None:
            self._core.release()


def engine_host_class(max_restarts: int = -1):
    """The Ray actor class: restarts the engine on death, ``max_restarts`` times (-1: always)."""
    import ray

    return ray.remote(max_restarts=max_restarts, max_task_retries=0)(EngineHost)


def died_for_good(exc: Any, in_a_row: int) -> bool:
    """Whether an actor's ``ActorDiedError`` (the ``in_a_row``-th for its calls) means it will
    never come back. An actor whose constructor raised is never restarted by Ray (whatever
    ``max_restarts``): its death is final at once. Any other death answers a call in flight
    once while Ray restarts the actor (later calls wait for it); a second in a row means no
    restart."""
    return bool(exc.actor_init_failed) or in_a_row > 1


def wait_engines_ready(handles: dict[str, Any], timeout_s: float, progress=None) -> list[dict]:
    """Block until every actor's engine answers /health; raise RuntimeError when one failed to
    start, its actor is dead for good (:func:`died_for_good`), or time runs out, naming it
    and its log or cause."""
    import ray
    from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

    t0 = time.monotonic()
    deaths: dict[str, int] = {}
    while True:
        infos = {}
        for name, handle in handles.items():
            try:
                infos[name] = ray.get(handle.info.remote(), timeout=30)
                deaths.pop(name, None)
            except ActorDiedError as exc:
                deaths[name] = deaths.get(name, 0) + 1
                if died_for_good(exc, deaths[name]):
                    raise RuntimeError(f"engine actor {name} died: {exc}") from exc
                log.info("%s died; waiting for Ray to restart it: %s", name, exc)
            except (RayActorError, GetTimeoutError) as exc:  # placing, starting or restarting
                log.debug("%s not answering yet: %s", name, exc)
        failed = [i["failed"] for i in infos.values() if i["failed"]]
        if failed:
            raise RuntimeError("engine failed to start: " + "; ".join(failed))
        pending = [n for n in handles if not infos.get(n, {}).get("healthy")]
        if progress is not None:
            progress(time.monotonic() - t0, pending)
        if not pending:
            return list(infos.values())
        if time.monotonic() - t0 > timeout_s:
            logs = ", ".join(infos[n]["log"] for n in pending if n in infos)
            raise RuntimeError(f"engines {pending} not ready after {timeout_s:.0f}s (logs: {logs})")
        time.sleep(1.0)
