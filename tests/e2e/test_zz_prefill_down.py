"""With the prefill engine gone, requests still succeed, served locally, and it is counted; a
hand-off whose KV died with it is recomputed by decode; then the decode engine dies mid-stream,
and dev mode brings both back (restarting them at once: one engine start less to wait for).

Runs last in the package (file name): it kills the shared stack's engines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from harness.engine_io import prompt_sources, success_count
from harness.prompts import text_of_tokens
from harness.routes import wait_for
from tests.e2e.conftest import TINY_PORTS
from transport import kv_params

FALLBACK = 'pd_fallbacks_total{reason="prefill_unreachable"}'
#: The same fallback when the engine was marked down (its exit seen by the supervisor or a
#: probe) while the request was on its way to it: which of the two a request meets is a race.
LOST_FALLBACK = 'pd_fallbacks_total{reason="prefill_lost"}'
UNAVAILABLE = 'pd_decisions_total{reason="prefill_unavailable",route="local"}'
#: The decode engine's process group when a test killed it, for the restart test to compare.
KILLED: dict[str, int] = {}


def sample(metrics: str, series: str) -> float:
    """One series' value in a Prometheus text (0 when absent)."""
    for line in metrics.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def prefill_handoff(stack, body: dict) -> kv_params.PrefillHandoff:
    """Run only the prefill leg, straight on the prefill engine."""
    pbody = dict(body, max_tokens=1, return_token_ids=True, stream=False)
    pbody[kv_params.BODY_KEY] = kv_params.prefill_request_params()
    reply = httpx.post(stack.prefill_url + "/v1/completions", json=pbody, timeout=60,
                       headers=stack.engine_headers)
    assert reply.status_code == 200, reply.text
    return kv_params.parse_prefill_reply(reply.json())


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
    # A hand-off made just before the prefill engine dies: its KV can never be pulled.
    stale_body = {"model": tiny_stack.model_name, "max_tokens": 12, "temperature": 0,
                  "prompt": text_of_tokens(600, seed=77)}
    stale = prefill_handoff(tiny_stack, stale_body)
    before = httpx.get(tiny_stack.proxy_url + "/metrics", timeout=10).text
    fallbacks_before = sample(before, FALLBACK) + sample(before, LOST_FALLBACK)
    unavailable_before = sample(before, UNAVAILABLE)
    os.killpg(tiny_stack.engine_pid("prefill"), signal.SIGKILL)
    body = {"model": tiny_stack.model_name, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4, "temperature": 0}
    with httpx.Client(timeout=60, headers=tiny_stack.engine_headers) as client:
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
        # Either the first request fell back (prefill unreachable, or marked down while the
        # request was on its way: a counted fallback) and the next skipped it, or the engine
        # was marked down first and both were decided local up front: every request is
        # accounted for either way.
        fell_back = sample(metrics, FALLBACK) + sample(metrics, LOST_FALLBACK) - fallbacks_before
        decided = sample(metrics, UNAVAILABLE) - unavailable_before
        assert (fell_back, decided) in ((1, 1), (0, 2)), (fell_back, decided)
        deadline = time.monotonic() + 10
        while client.get(tiny_stack.proxy_url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "health still ready with prefill down"
            time.sleep(0.5)

        # The decode engine given the dead prefill's hand-off cannot pull the KV: it recomputes
        # the prompt (kv_load_failure_policy=recompute) and answers exactly as it would alone.
        before = prompt_sources(tiny_stack.decode_url)
        dbody = dict(stale_body)
        dbody[kv_params.BODY_KEY] = kv_params.decode_request_params(stale)
        r = client.post(tiny_stack.decode_url + "/v1/completions", json=dbody)
        assert r.status_code == 200, r.text
        after = prompt_sources(tiny_stack.decode_url)
        alone = client.post(tiny_stack.decode_url + "/v1/completions", json=stale_body).json()
        assert r.json()["choices"][0]["text"] == alone["choices"][0]["text"]
        assert after["external_kv_transfer"] == before["external_kv_transfer"]
        assert after["local_compute"] - before["local_compute"] >= 600 - 16
        # Nothing the client saw tells: the proxy counts it from the engine's own metrics.
        engines = client.get(tiny_stack.proxy_url + "/pd/costs").json()["engines"]
        (decode,) = [n for n, e in engines.items() if e["url"] == tiny_stack.decode_url]
        series = f'pd_kv_pull_failures_total{{engine="{decode}"}}'
        wait_for(lambda: sample(client.get(tiny_stack.proxy_url + "/metrics").text,
                                series) >= 1, "the proxy to count the failed pull", 15)
        assert client.get(tiny_stack.proxy_url + "/pd/costs").json()[
            "engines"][decode]["kv_pull_failures"] >= 1


def test_decode_killed_mid_stream_ends_the_stream_with_an_error(tiny_stack):
    """The last engine crashes mid-answer (the prefill engine is down or restarting after the
    test above: dev mode restarts both at once, and the tests below wait for them). The client
    gets an in-band error event and the stream closes within seconds (never a hang); /health
    says not ready."""
    body = {"model": tiny_stack.model_name, "max_tokens": 3000, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": "count to a thousand"}]}
    with httpx.Client(timeout=30) as c, c.stream(
            "POST", tiny_stack.proxy_url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        KILLED["decode"] = tiny_stack.engine_pid("decode")
        os.killpg(KILLED["decode"], signal.SIGKILL)
        t0 = time.monotonic()
        rest = [ln for ln in lines if ln]
        ended_after = time.monotonic() - t0
    assert rest[-2:-1] and '"error"' in rest[-2] and rest[-1] == "data: [DONE]", rest[-3:]
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["type"] == "upstream_error"
    assert ended_after < 5, ended_after
    assert httpx.get(tiny_stack.proxy_url + "/health", timeout=5).status_code == 503
    metrics = httpx.get(tiny_stack.proxy_url + "/metrics", timeout=5).text
    assert 'pd_stream_errors_total{reason="decode_lost"} 1.0' in metrics


def wait_back(stack, client: httpx.Client, name: str, timeout_s: float = 300) -> None:
    """Until the proxy sees engine ``name`` healthy and warmed up again."""
    deadline = time.monotonic() + timeout_s
    while True:
        engine = client.get(stack.proxy_url + "/pd/costs").json()["engines"][name]
        if engine["healthy"] and not engine["warming"]:
            return
        assert time.monotonic() < deadline, f"{name} not back: {stack.output()[-2000:]}"
        time.sleep(0.5)


def test_prefill_restarted_by_dev_mode_serves_pd_again(tiny_stack):
    """Dev mode restarted the killed prefill engine (same ports, new process). The proxy saw it
    come back, paid the new pair's NIXL handshake with a warm-up request before routing users
    to it, and requests are disaggregated again, their KV pulled over NIXL."""
    # Run alone (the prefill never killed): kill it here. After the test above it is down, or
    # back with "restarted" in the log.
    view = httpx.get(tiny_stack.proxy_url + "/pd/costs", timeout=10).json()["engines"]
    if view["prefill-0"]["healthy"] and "restarted" not in tiny_stack.output():
        os.killpg(tiny_stack.engine_pid("prefill"), signal.SIGKILL)
        time.sleep(3)  # the proxy's 1 s health probe sees it down
    with httpx.Client(timeout=60, headers=tiny_stack.engine_headers) as client:
        wait_back(tiny_stack, client, "prefill-0")
        wait_back(tiny_stack, client, "decode-0")  # killed by the test above
        pid = tiny_stack.engine_pid("prefill")
        assert os.path.exists(f"/proc/{pid}"), "run.json names the restarted engine"
        assert client.get(tiny_stack.proxy_url + "/health").status_code == 200
        # The warm-up already went through the new prefill engine.
        assert success_count(tiny_stack.prefill_url) >= 1
        before = prompt_sources(tiny_stack.decode_url)
        body = {"model": tiny_stack.model_name, "max_tokens": 8, "temperature": 0,
                "prompt": text_of_tokens(400, seed=78)}
        r = client.post(tiny_stack.proxy_url + "/v1/completions", json=body)
        assert r.status_code == 200 and r.headers["x-pd-route"] == "disaggregated", r.text
        pulled = prompt_sources(tiny_stack.decode_url)["external_kv_transfer"]
        assert pulled - before["external_kv_transfer"] >= 400 - 16
        alone = client.post(tiny_stack.decode_url + "/v1/completions", json=body).json()
        assert r.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    assert "restarted" in tiny_stack.output()


def test_zz_decode_restarted_by_dev_mode_serves_pd_again(tiny_stack):
    """Dev mode restarted the killed decode engine (``launch/supervisor.py``: same ports, new
    process). The proxy saw it come back and warmed the pair up before users; /health is 200
    again and a request is disaggregated, its KV pulled by the new engine over NIXL."""
    # Run alone (the decode never killed): kill it here.
    if "decode" not in KILLED:
        KILLED["decode"] = tiny_stack.engine_pid("decode")
        os.killpg(KILLED["decode"], signal.SIGKILL)
        time.sleep(3)  # the proxy's 1 s health probe sees it down
    killed = KILLED["decode"]
    with httpx.Client(timeout=60, headers=tiny_stack.engine_headers) as client:
        wait_back(tiny_stack, client, "decode-0")
        pid = tiny_stack.engine_pid("decode")
        assert pid != killed and os.path.exists(f"/proc/{pid}"), "a new decode process"
        assert client.get(tiny_stack.proxy_url + "/health").status_code == 200
        before = prompt_sources(tiny_stack.decode_url)
        body = {"model": tiny_stack.model_name, "max_tokens": 8, "temperature": 0,
                "prompt": text_of_tokens(400, seed=79)}
        r = client.post(tiny_stack.proxy_url + "/v1/completions", json=body)
        assert r.status_code == 200 and r.headers["x-pd-route"] == "disaggregated", r.text
        pulled = prompt_sources(tiny_stack.decode_url).get("external_kv_transfer", 0.0)
        assert pulled - before.get("external_kv_transfer", 0.0) >= 400 - 16
        alone = client.post(tiny_stack.decode_url + "/v1/completions", json=body).json()
        assert r.json()["choices"][0]["text"] == alone["choices"][0]["text"]
