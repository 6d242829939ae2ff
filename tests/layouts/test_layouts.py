"""Layouts on real engines: the aggregated layout serves whole requests on both engines with
their own greedy output; the same two engines switched at run time to a pool where each one
prefills for the other on some requests and pulls KV on others (vLLM's ``kv_both``), and to a
fixed 1P+1D split."""

from __future__ import annotations

import httpx
import pytest

from harness.engine_io import stream_text, success_count
from harness.prompts import text_of_tokens
from harness.routes import costs, wait_for
from transport.engine_metrics import engine_load

MAX_TOKENS = 16


def body(stack, endpoint: str, n: int, seed: int, stream: bool = False) -> dict:
    text = text_of_tokens(n, seed=seed)
    out = {"model": stack.model_name, "max_tokens": MAX_TOKENS, "temperature": 0,
           "stream": stream}
    if endpoint == "chat":
        out["messages"] = [{"role": "user", "content": text}]
    else:
        out["prompt"] = text
    return out


def path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def text_of(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def engine_urls(stack) -> list[str]:
    return [e["url"] for e in stack.run_info()["engines"]]


def nixl_pulls(url: str) -> float:
    return engine_load(httpx.get(url + "/metrics", timeout=10).text).nixl_transfers


def route(stack, idle: bool = True, **settings) -> dict:
    """Set the routing; with ``idle``, then wait until the proxy's last look at both engines
    found them idle (requests sent straight to an engine count as its load for a second or
    so)."""
    r = httpx.post(stack.proxy_url + "/pd/admin/routing", json=settings, timeout=10)
    assert r.status_code == 200, r.text
    if idle:
        wait_for(lambda: all(e["engine_requests"] == 0
                             for e in costs(stack)["engines"].values()),
                 "both engines idle", timeout_s=30)
    return r.json()


@pytest.fixture
def aggregated(pool_stack):
    route(pool_stack, policy="auto", prefill=[], decode=["engine-0", "engine-1"])
    yield pool_stack
    route(pool_stack, policy="auto", prefill=[], decode=["engine-0", "engine-1"])


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_aggregated_serves_whole_requests_with_the_engines_own_output(aggregated, endpoint,
                                                                       stream):
    stack = aggregated
    urls = engine_urls(stack)
    assert [e["role"] for e in stack.run_info()["engines"]] == ["both", "both"]
    before = [success_count(u) for u in urls]
    got: list[str] = []
    with httpx.Client(timeout=120, headers=stack.engine_headers) as c:
        offset = 100 * stream + 10 * (endpoint == "chat")  # fresh prompts: no cache hit
        bodies = [body(stack, endpoint, 300, offset + seed) for seed in range(4)]
        for b in bodies:
            if stream:
                text, headers = (_stream_chat(c, stack.proxy_url + path(endpoint), b)
                                 if endpoint == "chat"
                                 else _stream_completion(c, stack.proxy_url + path(endpoint), b))
            else:
                r = c.post(stack.proxy_url + path(endpoint), json=b)
                assert r.status_code == 200, r.text
                text, headers = text_of(r.json()), r.headers
            assert headers["x-pd-route"] == "local"
            got.append(text)
        # Each proxied request ran whole on one engine; between them both engines served some.
        served = [success_count(u) - b for u, b in zip(urls, before)]
        assert sum(served) == 4 and min(served) >= 1, served
        for b, text in zip(bodies, got):  # the engine's own greedy output, asked directly
            assert text == text_of(c.post(urls[0] + path(endpoint), json=b).json())


def _stream_chat(c: httpx.Client, url: str, b: dict) -> tuple[str, httpx.Headers]:
    text, headers, _ = stream_text(c, url, dict(b, stream=True))
    return text, headers


def _stream_completion(c: httpx.Client, url: str, b: dict) -> tuple[str, httpx.Headers]:
    import json

    parts = []
    with c.stream("POST", url, json=dict(b, stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                parts += [ch.get("text") or "" for ch in json.loads(line[6:])["choices"]]
        return "".join(parts), r.headers


def test_each_engine_prefills_for_the_other_and_pulls_from_it(pool_stack):
    """Switched to a pool at run time: every request is P/D between the two engines, each
    engine pulls KV on some requests (its own NIXL counter) and so was the prefill for the
    other's; the text is still the engine's own greedy output."""
    stack = pool_stack
    urls = engine_urls(stack)
    view = route(stack, policy="disaggregate", prefill=["engine-0", "engine-1"],
                 decode=["engine-0", "engine-1"])
    assert view["engines"]["engine-0"]["duties"] == ["decode", "prefill"]
    try:
        pulls = [nixl_pulls(u) for u in urls]
        bodies = [body(stack, "completions", 400, seed) for seed in range(10, 16)]
        with httpx.Client(timeout=120, headers=stack.engine_headers) as c:
            got = []
            for b in bodies:  # fresh prompts first: no engine has one cached yet
                r = c.post(stack.proxy_url + "/v1/completions", json=b)
                assert r.status_code == 200 and r.headers["x-pd-route"] == "disaggregated"
                got.append(text_of(r.json()))
            gained = [nixl_pulls(u) - p for u, p in zip(urls, pulls)]
            assert min(gained) >= 1, gained  # both engines were consumers, so both producers
            for b, text in zip(bodies, got):
                assert text == text_of(c.post(urls[1] + "/v1/completions", json=b).json())
    finally:
        route(stack, policy="auto", prefill=[], decode=["engine-0", "engine-1"])


def test_a_fixed_split_decodes_on_one_engine_only(pool_stack):
    stack = pool_stack
    urls = engine_urls(stack)
    route(stack, policy="disaggregate", prefill=["engine-0"], decode=["engine-1"])
    try:
        pulls = [nixl_pulls(u) for u in urls]
        with httpx.Client(timeout=120) as c:
            for seed in range(20, 24):
                r = c.post(stack.proxy_url + "/v1/completions",
                           json=body(stack, "completions", 400, seed))
                assert r.status_code == 200 and r.headers["x-pd-route"] == "disaggregated"
        gained = [nixl_pulls(u) - p for u, p in zip(urls, pulls)]
        assert gained[0] == 0 and gained[1] >= 4, gained
    finally:
        route(stack, policy="auto", prefill=[], decode=["engine-0", "engine-1"])


def test_bad_routing_changes_are_refused_and_change_nothing(pool_stack):
    before = httpx.get(pool_stack.proxy_url + "/pd/admin/routing", timeout=10).json()
    for bad in ({"decode": []}, {"prefill": ["nope"]}, {"policy": "sometimes"},
                {"decode": "engine-0"}):
        r = httpx.post(pool_stack.proxy_url + "/pd/admin/routing", json=bad, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(pool_stack.proxy_url + "/pd/admin/routing", timeout=10).json() == before
