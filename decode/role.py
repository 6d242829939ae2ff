"""The decode role: pull a prompt's KV from a prefill engine (or compute it when routed local),
then generate.

Decode keeps a chunked-prefill budget (vLLM's default on these machines, set explicitly so the
proxy's step model knows it), so a prompt it computes itself (the local route) stalls the running
streams one chunk per step, not for a whole long prompt.
"""

from __future__ import annotations

#: Prompt tokens (with the decoding streams' tokens) one step of a decode engine computes.
CHUNK_TOKENS = 2048


def vllm_args(max_model_len: int) -> list[str]:
    """Role-specific arguments for ``vllm.entrypoints.openai.api_server``."""
    del max_model_len
    return ["--max-num-batched-tokens", str(CHUNK_TOKENS)]
