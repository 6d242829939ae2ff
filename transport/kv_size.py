"""KV bytes per token from a model's Hugging Face config: what one token's cache weighs on a link.

Standard attention stores a key and a value per layer and KV head:
``2 x layers x kv_heads x head_size x dtype_bytes``; tensor parallelism splits KV heads across
ranks, each rank moving its share over its own link (so per-link bytes divide by TP, with at least
one KV head per rank). MLA models (DeepSeek-V2/V3 style) cache one compressed latent per layer,
``(kv_lora_rank + qk_rope_head_dim) x layers x dtype_bytes``, replicated on every TP rank.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_size: int
    mla_latent: int = 0  # kv_lora_rank + qk_rope_head_dim for MLA models, else 0

    @property
    def is_mla(self) -> bool:
        return self.mla_latent > 0


def kv_shape(config: Mapping[str, Any]) -> KVShape:
    """Read the KV-relevant shape from a HF ``config.json`` (text config if nested)."""
    cfg = config.get("text_config") or config
    layers = int(cfg["num_hidden_layers"])
    if cfg.get("kv_lora_rank"):
        latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        return KVShape(layers=layers, kv_heads=1, head_size=latent, mla_latent=latent)
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_size = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return KVShape(layers=layers, kv_heads=kv_heads, head_size=head_size)


def kv_bytes_per_token(shape: KVShape, kv_dtype: str = "bfloat16", tp: int = 1) -> int:
    """Bytes of KV one token adds, per tensor-parallel rank (what crosses one rank's link)."""
    if tp < 1:
        raise ValueError("tp must be >= 1")
    try:
        dtype_bytes = DTYPE_BYTES[kv_dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}") from None
    if shape.is_mla:
        return shape.layers * shape.mla_latent * dtype_bytes
    heads_per_rank = max(1, -(-shape.kv_heads // tp))  # ceil; heads replicate when tp > kv_heads
    return 2 * shape.layers * heads_per_rank * shape.head_size * dtype_bytes


def kv_bytes_per_token_for_model(model_dir: str | Path, kv_dtype: str, tp: int = 1) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return kv_bytes_per_token(kv_shape(config), kv_dtype, tp)
