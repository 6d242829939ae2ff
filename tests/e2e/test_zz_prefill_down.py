"""With the prefill engine gone, requests still succeed, served locally, and it is counted.

Runs last in the session (file name): it kills the shared stack's prefill engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.e2e.conftest import TINY_PORTS


def test_second_dev_on_busy_ports_fails_clearly(tiny_stack, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "launch.cli", "dev", "--model", "tiny",
         "--port", str(TINY_PORTS["port"]), "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 2
    assert "already in use" in r.stderr and str(TINY_PORTS["port"]) in r.stderr
    assert "Traceback" not in r.stderr


def test_prefill_down_serves_local(tiny_stack):
    os.killpg(tiny_stack.engine_pid("prefill"), signal.SIGKILL)
    body = {"model": tiny_stack.model_name, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4, "temperature": 0}
    with httpx.Client(timeout=60) as client:
        for stream in (False, True):
            r = client.post(tiny_stack.proxy_url + "/v1/chat/completions",
                            json=dict(body, stream=stream))
            assert r.status_code == 200, r.text
            assert r.headers["x-pd-route"] == "local"
            if stream:
                assert r.text.rstrip().endswith("data: [DONE]")
            else:
                assert r.json()["usage"]["completion_tokens"] == 4
        metrics = client.get(tiny_stack.proxy_url + "/metrics").text
        # The first request found prefill unreachable; later ones skip it (marked down).
        assert 'pd_fallbacks_total{reason="prefill_unreachable"} 1.0' in metrics
        assert 'pd_decisions_total{reason="prefill_unavailable",route="local"}' in metrics
        deadline = time.monotonic() + 10
        while client.get(tiny_stack.proxy_url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "health still ready with prefill down"
            time.sleep(0.5)
