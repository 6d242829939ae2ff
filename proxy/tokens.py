"""Prompt token ids at the proxy, rendered the way vLLM's OpenAI server renders them.

Used to size a prompt exactly and to look it up in the prefix indexes before routing. Chat:
the tokenizer's chat template with the generation prompt, then encoding without special tokens;
completions: a string prompt encoded with special tokens, a token-id list taken as is.
A prompt that cannot be rendered here returns None (the proxy falls back to estimates; the
engine still validates and renders it).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class PromptTokenizer:
    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        self._tok.model_max_length = 1 << 30  # lengths are the engine's to check, not ours

    def ids(self, body: dict[str, Any]) -> list[int] | None:
        try:
            if "messages" in body:
                text = self._tok.apply_chat_template(
                    body["messages"], add_generation_prompt=True, tokenize=False
                )
                return list(self._tok.encode(text, add_special_tokens=False))
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return list(self._tok.encode(prompt, add_special_tokens=True))
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return list(prompt)
        except Exception as exc:  # noqa: BLE001 - any template/encoding failure: no estimate
            log.debug("cannot tokenize prompt at the proxy: %s", exc)
        return None
