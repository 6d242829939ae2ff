"""KV sizing and the cost formulas."""

from __future__ import annotations

import pytest

from transport.cost import LinkModel, PrefillModel, breakeven_bytes_per_s, crossover_tokens
from transport.kv_size import KVShape, kv_bytes_per_token, kv_shape

LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096}
LLAMA_70B = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "hidden_size": 8192}
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576}
TINY = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 256, "head_dim": 64}
DEEPSEEK_V3 = {"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
               "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64}


@pytest.mark.parametrize(
    "config,dtype,tp,expected",
    [
        (LLAMA_8B, "bfloat16", 1, 128 * 1024),  # ANCHORS: 128 KiB
        (LLAMA_70B, "bfloat16", 1, 320 * 1024),  # ANCHORS: 320 KiB
        (LLAMA_70B, "bfloat16", 8, 40 * 1024),  # one KV head per rank
        (LLAMA_8B, "bfloat16", 16, 16 * 1024),  # tp > kv heads: heads replicate, 1 per rank
        (SMOLLM2, "float32", 1, 46080),  # STACK: 46 KiB
        (TINY, "float32", 1, 4096),  # STACK: 4 KiB
        (LLAMA_8B, "fp8", 1, 64 * 1024),
        (DEEPSEEK_V3, "bfloat16", 1, 61 * 576 * 2),  # MLA latent, not heads
        (DEEPSEEK_V3, "bfloat16", 8, 61 * 576 * 2),  # MLA is replicated across TP
    ],
)
def test_kv_bytes_per_token(config, dtype, tp, expected):
    assert kv_bytes_per_token(kv_shape(config), dtype, tp) == expected


def test_nested_text_config_and_errors():
    assert kv_shape({"text_config": TINY}) == KVShape(4, 2, 64)
    with pytest.raises(ValueError):
        kv_bytes_per_token(KVShape(4, 2, 64), "float13")
    with pytest.raises(ValueError):
        kv_bytes_per_token(KVShape(4, 2, 64), "float32", tp=0)


def test_prefill_model_grows_superlinearly():
    m = PrefillModel(fixed_s=0.01, tokens_per_s=1000.0, quad_s=1e-7)
    assert m.seconds(0) == 0.0
    assert m.seconds(1000) == pytest.approx(0.01 + 1.0 + 0.1)
    assert m.seconds(2000) - m.seconds(1000) > m.seconds(1000) - m.seconds(0) - 0.01


def test_breakeven_matches_anchor():
    # 8B on one H100 at ~30k tokens/s prefill: ~4 GB/s (ANCHORS).
    assert breakeven_bytes_per_s(128 * 1024, 30_000) == pytest.approx(3.93e9, rel=0.01)


def test_crossover_when_prefill_is_cached_remotely():
    # Remote prefill costs nothing (prefix cached there); transfer vs local recompute.
    free = PrefillModel(fixed_s=0.0, tokens_per_s=1e12)
    local = PrefillModel(fixed_s=0.0, tokens_per_s=1000.0)
    link = LinkModel(fixed_s=0.05, bytes_per_s=4096 * 4000.0)  # 4000 tok/s of KV
    n = crossover_tokens(4096, link, free, local)
    # 0.05 + n/4000 < n/1000  <=>  n > 66.7
    assert n == 67


def test_crossover_never_when_link_slower_than_recompute():
    local = PrefillModel(fixed_s=0.0, tokens_per_s=1000.0)
    link = LinkModel(fixed_s=0.0, bytes_per_s=4096 * 500.0)
    assert crossover_tokens(4096, link, local, local, max_tokens=1 << 16) is None
