"""The decode role: pull a prompt's KV from a prefill engine (or compute it when routed local),
then generate.

Decode keeps vLLM's default chunked-prefill budget, so a prompt it computes itself (the local
route) does not stall running streams for a whole long prompt.
"""

from __future__ import annotations

from transport.connector import Role

ROLE: Role = "decode"


def vllm_args(max_model_len: int) -> list[str]:
    """Role-specific arguments for ``vllm.entrypoints.openai.api_server``."""
    del max_model_len
    return []
