"""Start, watch and stop engine processes; no orphans whatever way the parent ends.

Each engine runs in its own process group (so its worker children die with it); ``stop`` sends
SIGTERM to the group, waits, then SIGKILLs what is left.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from launch import reaper
from launch.engines import EngineSpec, engine_argv, engine_env
from launch.isolation import confine, parse_cores

#: ``ValueError: ...``, ``torch.OutOfMemoryError: ...``, ``RuntimeError: ...`` (a traceback's end).
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)?(Error|Exception|Exit)\b[\w.]*: ")


#: How a restart's banner starts in an engine's log (appended to, not rewritten, on a restart).
RESTART_BANNER = "===== pdserve: "

#: vLLM prefixes its engine-core process's lines: ``(EngineCore_DP0 pid=123) ...``.
_PROCESS_PREFIX = re.compile(r"^\([^)]*\)\s*")


class PortBusy(RuntimeError):
    pass


class EngineFailed(RuntimeError):
    pass


def check_port_plan(ports: Sequence[tuple[str, int]]) -> None:
    """Raise ValueError for a (purpose, port) outside 1-65535, or a port given two purposes
    (each would be free on its own: the second server to bind it would fail, after the
    engines had loaded)."""
    bad = [f"{port} ({purpose})" for purpose, port in ports if not 1 <= port <= 65535]
    if bad:
        raise ValueError("port(s) out of range 1-65535: " + ", ".join(bad))
    owners: dict[int, list[str]] = {}
    for purpose, port in ports:
        owners.setdefault(port, []).append(purpose)
    shared = [f"{port} ({' and '.join(names)})" for port, names in owners.items()
              if len(names) > 1]
    if shared:
        raise ValueError("port(s) given twice: " + ", ".join(shared) + ". Pick ports apart "
                         "(--port, --engine-base-port: prefill engine on it, decode on the "
                         "next; --side-channel-base-port; --kv-events-base-port; "
                         "--prometheus-port).")


def check_ports_free(ports: Sequence[tuple[str, int]], host: str = "127.0.0.1") -> None:
    """Raise PortBusy naming every (purpose, port) that something else already holds."""
    busy = []
    for purpose, port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # Like the servers themselves: a port left in TIME_WAIT by a stopped run is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                busy.append(f"{port} ({purpose})")
    if busy:
        raise PortBusy(
            "port(s) already in use: " + ", ".join(busy)
            + ". Is another pdserve running? Stop it or pick other ports (--port, "
            "--engine-base-port)."
        )


def check_endpoints_free(endpoints: Sequence[tuple[str, str]]) -> None:
    """Raise PortBusy naming every (purpose, endpoint) that something already serves: TCP
    ports (``tcp://host:port``, checked on loopback like :func:`check_ports_free`) and Unix
    sockets (``ipc://path``, which ZMQ would silently take over from their owner)."""
    busy = []
    for purpose, endpoint in endpoints:
        if endpoint.startswith("ipc://"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(endpoint.removeprefix("ipc://"))
                except OSError:
                    continue
            busy.append(f"{endpoint} ({purpose})")
        elif endpoint.startswith("tcp://"):
            try:
                check_ports_free([(purpose, int(endpoint.rsplit(":", 1)[1]))])
            except PortBusy:
                busy.append(f"{endpoint} ({purpose})")
    if busy:
        raise PortBusy("already in use: " + ", ".join(busy) + ". Is another pdserve running? "
                       "Stop it or pick other ports (--kv-events-base-port).")


@dataclass
class EngineProcess:
    spec: EngineSpec
    popen: subprocess.Popen
    log_path: Path

    @property
    def name(self) -> str:
        return f"{self.spec.role}:{self.spec.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def _log_lines(self) -> list[str]:
        """This run's lines of the engine's log: those after the last restart's banner."""
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return []
        starts = [i for i, line in enumerate(lines) if line.startswith(RESTART_BANNER)]
        return lines[starts[-1] + 1:] if starts else lines

    def last_log_line(self) -> str:
        lines = self._log_lines()
        return lines[-1][-160:] if lines else ""

    def root_cause(self) -> str:
        """The line of the engine's log that says why it died: the last exception this run
        raised that is not vLLM's "see root cause above" wrapper (an engine's last line is
        usually a warning printed while it shut down), else the last line."""
        lines = self._log_lines()
        for line in reversed(lines):
            text = _PROCESS_PREFIX.sub("", line.strip())
            if _EXCEPTION_LINE.match(text) and "root cause above" not in text:
                return text[-300:]
        return lines[-1][-160:] if lines else ""

    def healthy(self, timeout_s: float = 1.0) -> bool:
        try:
            with urllib.request.urlopen(self.spec.url + "/health", timeout=timeout_s) as r:
                return r.status == 200
        except OSError:
            return False


def launch_argv(spec: EngineSpec, die_with_parent: bool) -> list[str]:
    """The engine's command line; one that must die with its parent runs under
    ``launch/reaper.py``, which takes the engine's own children (vLLM's engine core) with it."""
    argv = engine_argv(spec)
    return [sys.executable, "-m", reaper.__name__, "--", *argv] if die_with_parent else argv


def open_log(path: Path, append: bool) -> BinaryIO:
    """An engine's log for writing: never through a link planted at ``path`` (OSError), and
    readable by this user only (it holds prompts)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, 0o600), "ab" if append else "wb")


def start_engine(spec: EngineSpec, log_dir: Path, die_with_parent: bool = True,
                 append_log: bool = False, own_session: bool = False) -> EngineProcess:
    """Start one engine, its log in ``log_dir``. ``die_with_parent``: under the reaper, which
    gets SIGTERM when this process ends however it ends (``reaper.popen_dying_with_us``) and
    stops everything the engine started; without it, an engine outlives a parent killed
    outright. ``own_session``: a session of its own (see below)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    cores = parse_cores(spec.cpu_cores) if spec.cpu_cores else None
    log_path = log_dir / f"{spec.role}-{spec.port}.log"
    log_file = open_log(log_path, append_log)
    if append_log:
        log_file.write(f"\n{RESTART_BANNER}{spec.role} engine restarted at "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S')} =====\n".encode())
        log_file.flush()
    argv = launch_argv(spec, die_with_parent)
    popen_kwargs: dict[str, Any] = dict(
        env=engine_env(spec),
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        # Its own process group (one killpg stops the API server and its engine core and
        # workers; a terminal's Ctrl-C reaches only pdserve). In dev mode not its own session:
        # Linux shares CPU between sessions ("autogroups") before tasks, so an engine in a
        # session of its own, whose workers spin between steps, held the proxy off a shared
        # core for a whole time slice at each of its wake-ups (measured: +2-4 ms per request
        # at c=1). A Ray actor's engine keeps a session of its own, as Ray's own teardown was
        # tested with.
        start_new_session=own_session,
        process_group=None if own_session else 0,
        # Its cores, inherited by every process and thread it starts (launch/isolation.py).
        preexec_fn=(lambda: confine(cores)) if cores else None,
    )
    try:
        popen = (reaper.popen_dying_with_us(argv, **popen_kwargs) if die_with_parent
                 else subprocess.Popen(argv, **popen_kwargs))
    finally:
        log_file.close()
    return EngineProcess(spec, popen, log_path)


def wait_ready(
    engines: Sequence[EngineProcess],
    timeout_s: float,
    on_progress: Callable[[float, list[EngineProcess]], None] | None = None,
) -> None:
    """Block until every engine answers /health; raise EngineFailed if one exits or time runs
    out."""
    t0 = time.monotonic()
    pending = list(engines)
    while pending:
        for e in list(pending):
            if not e.alive():
                raise EngineFailed(
                    f"{e.name} exited with code {e.popen.returncode}: {e.root_cause()!r} "
                    f"(full log: {e.log_path})"
                )
            if e.healthy():
                pending.remove(e)
        elapsed = time.monotonic() - t0
        if on_progress:
            on_progress(elapsed, pending)
        if not pending:
            return
        if elapsed > timeout_s:
            raise EngineFailed(
                f"{', '.join(e.name for e in pending)} not ready after {timeout_s:.0f}s "
                f"(logs: {', '.join(str(e.log_path) for e in pending)})"
            )
        time.sleep(0.5)


def stop_engines(engines: Sequence[EngineProcess], grace_s: float = 10.0) -> None:
    """SIGTERM every engine's process group, wait up to ``grace_s``, then SIGKILL the rest."""
    for e in engines:
        _signal_group(e.popen, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for e in engines:
        try:
            e.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for e in engines:
        _signal_group(e.popen, signal.SIGKILL)
        try:
            e.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass


@contextmanager
def reporting_shutdown() -> Iterator[None]:
    """Around a deployment's shutdown: say so on stderr, then how long it took."""
    print("stopping engines ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    yield
    print(f"stopped in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
