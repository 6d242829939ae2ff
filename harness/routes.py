"""Measure both routes of one request directly on the real engines (tests and benchmarks).

The stack must run with ``--engine-dev-endpoints`` (for ``/reset_prefix_cache``) and publish KV
events (the proxy's ``/pd/costs`` shows each engine's indexed blocks).
"""

from __future__ import annotations

import math
import time

import httpx

from harness.prompts import text_of_tokens
from transport import kv_params


def costs(stack) -> dict:
    return httpx.get(stack.proxy_url + "/pd/costs", timeout=10).json()


def wait_for(pred, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def cached_on(stack, body: dict, engine: str) -> int:
    """Leading tokens of ``body``'s prompt that the proxy's index says ``engine`` holds."""
    r = httpx.post(stack.proxy_url + "/pd/lookup", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["engines"][engine]["cached_tokens"]


def reset_decode_cache(stack, body: dict) -> None:
    """Empty the decode engine's prefix cache and wait until the proxy's index no longer
    holds ``body``'s prompt there.

    vLLM publishes KV events with scheduler steps, so an idle engine's reset reaches
    subscribers only with its next step: a one-token request (shorter than a block, so it
    caches nothing) provides that step."""
    def dropped() -> bool:
        # A reset fails (vLLM logs it) while a request holds blocks, e.g. one of the proxy's
        # link re-probes: so reset again until the index agrees.
        r = httpx.post(stack.decode_url + "/reset_prefix_cache", timeout=30,
                       headers=stack.engine_headers)
        assert r.status_code == 200, r.text
        httpx.post(stack.decode_url + "/v1/completions", timeout=60, headers=stack.engine_headers,
                   json={"model": stack.model_name, "prompt": "x", "max_tokens": 1})
        return cached_on(stack, body, "decode-0") == 0

    wait_for(dropped, "decode index to drop the prompt")


def cache_on_prefill(stack, doc: str, doc_tokens: int) -> None:
    """Compute ``doc`` on the prefill engine alone (a plain request: its prefix cache keeps it)
    and wait until the proxy's index has learned it from the engine's KV events."""
    body = {"model": stack.model_name, "prompt": doc, "max_tokens": 1}
    r = httpx.post(stack.prefill_url + "/v1/completions", timeout=120, json=body,
                   headers=stack.engine_headers)
    assert r.status_code == 200
    wait_for(lambda: cached_on(stack, body, "prefill-0") >= 0.8 * doc_tokens,
             "prefill index to learn the document")


def ttft_stream(client: httpx.Client, url: str, body: dict) -> tuple[float, httpx.Headers]:
    """Stream ``body`` to ``url``; return (seconds to the first data chunk, response headers)."""
    t0 = time.perf_counter()
    ttft = None
    with client.stream("POST", url, json=dict(body, stream=True)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - t0
    assert ttft is not None, "no data chunk"
    return ttft, r.headers


def measure_local(stack, body: dict) -> float:
    reset_decode_cache(stack, body)
    with httpx.Client(timeout=300, headers=stack.engine_headers) as c:
        return ttft_stream(c, stack.decode_url + "/v1/completions", body)[0]


def measure_disaggregated(stack, body: dict, give_up_after_s: float | None = None) -> float:
    """Prefill (prefix-cached there) then decode pulling the KV, timed like a client would.
    With ``give_up_after_s``: a prefill that has not answered by then is hung up on (vLLM aborts
    it) and the route measured as ``math.inf``, i.e. slower than that."""
    reset_decode_cache(stack, body)
    pbody = dict(body, max_tokens=1, return_token_ids=True, stream=False)
    pbody[kv_params.BODY_KEY] = kv_params.prefill_request_params()
    with httpx.Client(timeout=300, headers=stack.engine_headers) as c:
        t0 = time.perf_counter()
        try:
            reply = c.post(stack.prefill_url + "/v1/completions", json=pbody,
                           timeout=give_up_after_s or 300).json()
        except httpx.ReadTimeout:
            if give_up_after_s is None:
                raise
            return math.inf
        prefill_s = time.perf_counter() - t0
        dbody = dict(body)
        dbody[kv_params.BODY_KEY] = kv_params.decode_request_params(
            kv_params.parse_prefill_reply(reply))
        decode_ttft, _ = ttft_stream(c, stack.decode_url + "/v1/completions", dbody)
    return prefill_s + decode_ttft


def run_case(stack, doc_tokens: int, seed: int, repeats: int = 2, model: str = "tiny") -> dict:
    """One load-or-recompute case: a document cached on prefill only, then the proxy's choice
    and both routes measured directly on the engines (best of ``repeats``)."""
    doc = text_of_tokens(doc_tokens, seed=seed, model=model)
    body = {"model": stack.model_name, "prompt": doc + " and then", "max_tokens": 2,
            "temperature": 0}
    cache_on_prefill(stack, doc, doc_tokens)
    reset_decode_cache(stack, body)
    # The case is "idle queues": wait until the proxy's once-a-second look at the engines no
    # longer counts the requests just sent to set the case up (they would read as a queue).
    wait_for(lambda: all(e["engine_requests"] == 0 for e in costs(stack)["engines"].values()),
             "the proxy to see both engines idle", timeout_s=30)
    with httpx.Client(timeout=300) as c:
        ttft, headers = ttft_stream(c, stack.proxy_url + "/v1/completions", body)
    local = min(measure_local(stack, body) for _ in range(repeats))
    disagg = min(measure_disaggregated(stack, body) for _ in range(repeats))
    return {"route": headers["x-pd-route"], "estimate": headers.get("x-pd-estimate"),
            "ttft": ttft, "local": local, "disaggregated": disagg}
