"""The CLI's own limits, through `pdserve dev` on real engines (the README's rows "no / wrong
API key", "over capacity" and the whole-request deadline): the key from ``$PDSERVE_API_KEY``,
``--private-ops``, ``--max-inflight`` / ``--max-queued`` / ``--queue-timeout-s`` and
``--total-deadline-s``. Refused requests never reach an engine: each test counts the prompt
tokens both engines computed."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from harness.prompts import text_of_tokens
from harness.routes import wait_for
from harness.stack import Stack, serving, start_dev
from transport.engine_metrics import engine_load, sample_sums

KEY = "cli-limits-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: Short enough that a 3,000-token answer of the tiny model runs past it.
TOTAL_DEADLINE_S = 4.0


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> Stack:
    with serving(
        start_dev, model="tiny", port=18300, engine_base_port=18400,
        side_channel_base_port=15800, kv_events_base_port=15900,
        log_dir=tmp_path_factory.mktemp("limits-stack"), model_name="pdserve-tiny",
        env={"PDSERVE_API_KEY": KEY}, api_key=KEY,
        extra=["--policy", "disaggregate", "--kv-blocks", "512", "--probe-tokens", "",
               "--reprobe-s", "0", "--private-ops", "--max-inflight", "1", "--max-queued", "1",
               "--queue-timeout-s", "60", "--headers-deadline-s", "3",
               "--total-deadline-s", str(TOTAL_DEADLINE_S)],
    ) as stack:
        yield stack


def engine_sums(url: str) -> dict[str, float]:
    return sample_sums(httpx.get(url + "/metrics", timeout=10).text)


def prompt_tokens(stack: Stack) -> float:
    """Prompt tokens both engines have computed or been handed (what any request costs)."""
    return sum(engine_sums(u).get("vllm:prompt_tokens_total", 0.0)
               for u in (stack.prefill_url, stack.decode_url))


def idle(stack: Stack) -> None:
    for url in (stack.prefill_url, stack.decode_url):
        wait_for(lambda u=url: engine_load(httpx.get(u + "/metrics", timeout=10).text)
                 .requests == 0, f"{url} idle", timeout_s=60)


def body(stack: Stack, **extra) -> dict:
    return {"model": stack.model_name, "prompt": text_of_tokens(40, seed=11), "max_tokens": 4,
            "temperature": 0, **extra}


def test_the_key_from_the_environment_guards_the_api_and_private_ops(limited):
    before = prompt_tokens(limited)
    url = limited.proxy_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(url + "/v1/completions", json=body(limited), headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
        for path in ("/health", "/metrics", "/pd/costs"):  # --private-ops
            r = httpx.get(url + path, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
    assert prompt_tokens(limited) == before, "a refused request reached an engine"
    assert httpx.get(url + "/health", headers=AUTH, timeout=30).status_code == 200
    r = httpx.post(url + "/v1/completions", json=body(limited), headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-pd-route"] == "disaggregated"
    assert prompt_tokens(limited) > before


def test_past_inflight_and_queue_a_request_gets_503_and_the_queued_one_is_served(limited):
    """--max-inflight 1 --max-queued 1: one stream served, one request queued behind it, the
    third refused at once with Retry-After; the queued one is served when the stream ends."""
    idle(limited)
    url = limited.proxy_url
    queued: dict = {}

    def send_queued() -> None:
        r = httpx.post(url + "/v1/completions", json=body(limited), headers=AUTH, timeout=120)
        queued["status"], queued["t"] = r.status_code, time.monotonic()

    long = body(limited, max_tokens=3000, ignore_eos=True, stream=True)
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=long,
                                                 headers=AUTH) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(ln for ln in lines if ln.startswith("data: {"))  # it holds the one slot now
        waiter = threading.Thread(target=send_queued)
        waiter.start()
        wait_for(lambda: _queued(url) == 1, "the second request queued", timeout_s=30)
        before = prompt_tokens(limited)
        t0 = time.monotonic()
        refused = httpx.post(url + "/v1/completions", json=body(limited), headers=AUTH,
                             timeout=30)
        refused_after = time.monotonic() - t0
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "overloaded_error"
        assert int(refused.headers["retry-after"]) >= 1
        assert refused_after < 2, refused_after  # at once, not after the queue timeout
        assert prompt_tokens(limited) == before, "the refused request reached an engine"
        assert "status" not in queued  # still waiting behind the stream
        t_closed = time.monotonic()
    waiter.join(120)
    assert queued.get("status") == 200, queued
    assert queued["t"] >= t_closed


def _queued(url: str) -> float:
    """Requests the proxy has admitted or queued beyond the one served (its gauges)."""
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=10).text
    for line in text.splitlines():
        if line.startswith("pd_queued_requests "):
            return float(line.split()[1])
    raise AssertionError("no pd_queued_requests gauge")


def test_the_whole_request_deadline_ends_a_long_stream_and_the_engine_stops(limited):
    """A 3,000-token answer against a 4 s whole-request deadline: the stream ends with an
    in-band timeout_error and [DONE] at the deadline (not migrated: the engine is fine), and
    the decode engine aborts the rest."""
    idle(limited)
    generated = engine_sums(limited.decode_url).get("vllm:generation_tokens_total", 0.0)
    long = body(limited, max_tokens=3000, ignore_eos=True, stream=True)
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as c, c.stream("POST", limited.proxy_url + "/v1/completions",
                                                 json=long, headers=AUTH) as r:
        assert r.status_code == 200
        events = [ln for ln in r.iter_lines() if ln]
    elapsed = time.monotonic() - t0
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["type"] == "timeout_error", error
    assert TOTAL_DEADLINE_S - 0.5 < elapsed < TOTAL_DEADLINE_S + 5, elapsed
    idle(limited)
    ran = engine_sums(limited.decode_url)["vllm:generation_tokens_total"] - generated
    assert ran < 2500, f"the engine generated {ran:.0f} of 3000 tokens: not aborted"
