"""Start a real deployment (``pdserve dev`` or ``pdserve ray``) the way users start it, as a
subprocess; wait for its ``/health``; stop it and report any engine that survived. The one
launcher tests and benchmarks share.

Every stack is marked: its engines inherit ``PDSERVE_STACK_ID`` (dev mode's through the
process tree, Ray mode's through a local raylet), so :meth:`Stack.engine_pids` finds them in
either mode, including engines a supervisor or Ray restarted under new pids.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STACK_ENV = "PDSERVE_STACK_ID"
#: The deployment's engine key, chosen by the harness so tests may call engines directly.
ENGINE_KEY_ENV = "PDSERVE_ENGINE_KEY"
MODEL_NAMES = {"tiny": "pdserve-tiny", "smollm2": "SmolLM2-135M-Instruct"}


@dataclass
class Stack:
    mode: str  # "dev" | "ray"
    popen: subprocess.Popen
    proxy_url: str
    log_dir: Path
    model_name: str
    stack_id: str
    t_launch: float
    #: The secret the engines require on every path but /health and /metrics.
    engine_key: str = ""
    #: The proxy's API key, when the stack was started with one (its /health may need it).
    api_key: str | None = None
    #: Dev mode's engines (Ray mode: ask the proxy, ``engines()``).
    prefill_url: str = ""
    decode_url: str = ""
    t_health: float = 0.0
    stopped: bool = False
    survivors: list[int] = field(default_factory=list)

    @property
    def output_path(self) -> Path:
        return self.log_dir / f"pdserve-{self.mode}.out"

    @property
    def engine_headers(self) -> dict[str, str]:
        """Headers a direct call to one of this stack's engines needs."""
        return {"Authorization": f"Bearer {self.engine_key}"}

    @property
    def startup_s(self) -> float:
        return self.t_health - self.t_launch

    def output(self) -> str:
        try:
            return self.output_path.read_text(errors="replace")
        except OSError:
            return ""

    def run_info(self) -> dict[str, Any]:
        """Dev mode's ``run.json`` (pids, urls); {} before it is written and in Ray mode."""
        try:
            return json.loads((self.log_dir / "run.json").read_text())
        except (OSError, ValueError):
            return {}

    def engine_pid(self, role: str) -> int:
        return next(e["pid"] for e in self.run_info()["engines"] if e["role"] == role)

    @property
    def pgids(self) -> list[int]:
        """Dev mode: each engine's process group (its API server leads it)."""
        return [e["pid"] for e in self.run_info().get("engines", [])]

    def engines(self) -> dict[str, dict]:
        """The proxy's view of its engines (``/pd/costs``)."""
        with urllib.request.urlopen(self.proxy_url + "/pd/costs", timeout=10) as r:
            return json.loads(r.read())["engines"]

    def engine_pids(self) -> set[int]:
        return engine_pids(self.stack_id)

    def engine_process_pids(self) -> set[int]:
        return engine_process_pids(self.stack_id)

    def stop(self, timeout_s: float = 60.0, stop_signal: signal.Signals = signal.SIGTERM
             ) -> list[int]:
        """Signal the pdserve process to stop (it stops its engines); then SIGKILL any engine
        that is left, and return those (should be none). Idempotent."""
        if self.stopped:
            return self.survivors
        self.stopped = True
        started = set(self.pgids) | self.engine_process_pids()
        if self.popen.poll() is None:
            self.popen.send_signal(stop_signal)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                if self.mode == "ray":
                    os.killpg(self.popen.pid, signal.SIGKILL)
                else:
                    self.popen.kill()
                self.popen.wait(10)
        # An engine group may still be exiting as pdserve returns (a supervisor's restart
        # that was starting up): give it a few seconds before calling it a survivor.
        deadline = time.monotonic() + 10
        while True:
            left = sorted({p for p in started if group_alive(p)} | self.engine_process_pids())
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for pid in left:  # never leave engines behind, even when a test is about to fail
            for kill in (os.killpg, os.kill):  # its group when it leads one, and itself
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        self.survivors = left
        return left


def start_dev(model: str = "tiny", *, port: int, engine_base_port: int,
              side_channel_base_port: int, log_dir: Path,
              kv_events_base_port: int | None = None, policy: str | None = None,
              extra: Sequence[str] = (), model_name: str | None = None,
              timeout_s: float = 900.0, health_poll_s: float = 0.5,
              progress: Callable[[str], None] | None = None,
              env: Mapping[str, str] | None = None, api_key: str | None = None) -> Stack:
    """``pdserve dev`` on these ports (``env``: more environment for it and its engines);
    returns once its proxy answers ``/health`` (asked with ``api_key``, for a stack whose ops
    are private: the key itself reaches pdserve through ``env`` or ``extra``)."""
    argv = ["dev", "--model", model, "--port", str(port),
            "--engine-base-port", str(engine_base_port),
            "--side-channel-base-port", str(side_channel_base_port), "--log-dir", str(log_dir)]
    if kv_events_base_port is not None:
        argv += ["--kv-events-base-port", str(kv_events_base_port)]
    if policy is not None:
        argv += ["--policy", policy]
    stack = _launch("dev", [*argv, *extra], port, log_dir, model_name or _name(model),
                    timeout_s, health_poll_s, progress, env, api_key)
    stack.prefill_url = f"http://127.0.0.1:{engine_base_port}"
    stack.decode_url = f"http://127.0.0.1:{engine_base_port + 1}"
    return stack


def start_ray(model: str = "tiny", *, port: int, log_dir: Path, extra: Sequence[str] = (),
              model_name: str | None = None, timeout_s: float = 900.0,
              health_poll_s: float = 1.0, progress: Callable[[str], None] | None = None,
              env: Mapping[str, str] | None = None) -> Stack:
    """``pdserve ray`` (a local cluster unless ``extra`` gives ``--address``; ``env``: more
    environment for it); returns once its proxy answers ``/health``."""
    argv = ["ray", "--model", model, "--port", str(port), "--log-dir", str(log_dir / "engines")]
    return _launch("ray", [*argv, *extra], port, log_dir, model_name or _name(model),
                   timeout_s, health_poll_s, progress, env)


@contextmanager
def serving(start: Callable[..., Stack], stop_signal: signal.Signals = signal.SIGTERM,
            **kwargs: Any) -> Iterator[Stack]:
    """A fixture's stack: ``start(**kwargs)``, hand it out, then stop it with ``stop_signal``
    and check that pdserve exited and no engine process survived."""
    stack = start(**kwargs)
    try:
        yield stack
    finally:
        alive = stack.stop(stop_signal=stop_signal)
    assert stack.popen.returncode is not None, f"pdserve {stack.mode} did not exit"
    assert not alive, f"engine processes survived {stop_signal.name} of pdserve: {alive}"


def _launch(mode: str, argv: list[str], port: int, log_dir: Path, model_name: str,
            timeout_s: float, health_poll_s: float,
            progress: Callable[[str], None] | None,
            env: Mapping[str, str] | None = None, api_key: str | None = None) -> Stack:
    log_dir.mkdir(parents=True, exist_ok=True)
    stack_id = uuid.uuid4().hex
    engine_key = uuid.uuid4().hex
    out_path = log_dir / f"pdserve-{mode}.out"
    out = open(out_path, "wb")
    t_launch = time.perf_counter()
    popen = subprocess.Popen([sys.executable, "-m", "launch.cli", *argv], cwd=ROOT,
                             stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=dict(os.environ, **(env or {}), **{
                                 STACK_ENV: stack_id, ENGINE_KEY_ENV: engine_key}),
                             # Dev mode stays in the caller's session, as a user's terminal
                             # would run it (sessions are CPU-scheduling groups here:
                             # kernel.sched_autogroup_enabled); Ray mode gets its own, so its
                             # whole tree can be killed at once.
                             start_new_session=mode == "ray")
    out.close()
    stack = Stack(mode, popen, f"http://127.0.0.1:{port}", log_dir, model_name, stack_id,
                  t_launch, engine_key, api_key)
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    last_note = time.perf_counter()
    try:
        while http_status(stack.proxy_url + "/health", 1.0, auth) != 200:
            if popen.poll() is not None:
                raise RuntimeError(f"pdserve {mode} exited {popen.returncode}:\n"
                                   f"{stack.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"pdserve {mode} not ready in {timeout_s:.0f}s:\n"
                                   f"{stack.output()[-3000:]}")
            now = time.perf_counter()
            if progress is not None and now - last_note > 15:
                last_note = now
                progress(f"  waiting for the proxy's /health ({now - t_launch:.0f}s)")
            time.sleep(health_poll_s)
    except BaseException:
        stack.stop()
        raise
    stack.t_health = time.perf_counter()
    return stack


def _name(model: str) -> str:
    return MODEL_NAMES.get(model, Path(model).name)


def http_status(url: str, timeout: float = 2.0, headers: Mapping[str, str] | None = None
                ) -> int:
    """Status of a GET (0 when nothing answered)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=dict(headers or {})),
                                    timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


API_SERVER = "vllm.entrypoints.openai.api_server"


def engine_pids(stack_id: str) -> set[int]:
    """Live vLLM API server processes carrying ``stack_id`` in their environment (not the
    reaper a Ray actor runs each under, ``launch/reaper.py``, whose command line names it)."""
    return {pid for pid, cmd in _stack_processes(stack_id) if cmd[1:3] == ["-m", API_SERVER]}


def engine_process_pids(stack_id: str) -> set[int]:
    """Every live process of the stack's engines: API servers, their reapers, and vLLM's
    ``VLLM::EngineCore`` / ``VLLM::Worker`` children, which can outlive their API server."""
    return {pid for pid, cmd in _stack_processes(stack_id)
            if API_SERVER in cmd or (cmd and cmd[0].startswith("VLLM::"))}


def _stack_processes(stack_id: str) -> list[tuple[int, list[str]]]:
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.environ().get(STACK_ENV) == stack_id and p.status() != psutil.STATUS_ZOMBIE:
                found.append((p.pid, p.info["cmdline"] or []))
        except psutil.Error:
            continue
    return found


def group_alive(pgid: int) -> bool:
    """True while any live (non-zombie) process remains in process group ``pgid``.

    An engine's workers (VLLM::EngineCore, VLLM::Worker) share its group, and they can outlive
    the API server process: checking the leader alone would miss them.
    """
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
