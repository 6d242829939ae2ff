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
from typing import BinaryIO

from launch import reaper
from launch.engines import EngineSpec, engine_argv, engine_env
from launch.isolation import confine, parse_cores

#: ``ValueError: ...``, ``torch.OutOfMemoryError: ...``, ``RuntimeError: ...`` (a traceback's end).
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)?(Error|Exception|Exit)\b[\w.]*: ")


#: vLLM prefixes its engine-core process's lines: ``(EngineCore_DP0 pid=123) ...``.
_PROCESS_PREFIX = re.compile(r"^\([^)]*\)\s*")


class PortBusy(RuntimeError):
    pass


class EngineFailed(RuntimeError):
    pass


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

    def last_log_line(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][-160:] if lines else ""

    def root_cause(self) -> str:
        """The line of the engine's log that says why it died: the last exception raised that
        is not vLLM's "see root cause above" wrapper (an engine's last line is usually a
        warning printed while it shut down), else the last line."""
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            text = _PROCESS_PREFIX.sub("", line.strip())
            if _EXCEPTION_LINE.match(text) and "root cause above" not in text:
                return text[-300:]
        return lines[-1][-160:] if lines else ""

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.spec.url + "/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False


def _child_setup(cores: frozenset[int] | None, parent: int | None) -> None:
    """In the child, before exec: its cores (inherited by every process and thread the engine
    starts, ``launch/isolation.py``), and SIGTERM when ``parent`` (when given) dies."""
    if parent is not None:
        reaper.die_with_parent(parent)
    if cores:
        confine(cores)


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


def start_engine(spec: EngineSpec, log_dir: Path, die_with_parent: bool = False,
                 append_log: bool = False) -> EngineProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    cores = parse_cores(spec.cpu_cores) if spec.cpu_cores else None
    log_path = log_dir / f"{spec.role}-{spec.port}.log"
    parent = os.getpid() if die_with_parent else None
    log_file = open_log(log_path, append_log)
    if append_log:
        log_file.write(f"\n===== pdserve: {spec.role} engine restarted at "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S')} =====\n".encode())
        log_file.flush()
    popen = subprocess.Popen(
        launch_argv(spec, die_with_parent),
        env=engine_env(spec),
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        # Its own process group (one killpg stops the API server and its engine core and
        # workers; a terminal's Ctrl-C reaches only pdserve). In dev mode not its own session:
        # Linux shares CPU between sessions ("autogroups") before tasks, so an engine in a
        # session of its own, whose workers spin between steps, held the proxy off a shared
        # core for a whole time slice at each of its wake-ups (measured: +2-4 ms per request
        # at c=1). A Ray actor's engine (die_with_parent) keeps a session of its own, as Ray's
        # own teardown was tested with.
        start_new_session=die_with_parent,
        process_group=None if die_with_parent else 0,
        preexec_fn=lambda: _child_setup(cores, parent),
    )
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
