"""The prefill role: compute prompts, hold their KV for a decode engine to pull.

A prefill request asks for exactly one token, so the whole prompt should run as one engine step:
the batch budget is raised to the context length (no chunking).
"""

from __future__ import annotations


def vllm_args(max_model_len: int) -> list[str]:
    """Role-specific arguments for ``vllm.entrypoints.openai.api_server``."""
    return ["--max-num-batched-tokens", str(max(max_model_len, 2048))]
