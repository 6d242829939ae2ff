"""Prompt token ids at the proxy, rendered the way vLLM's OpenAI server renders them.

Used to size a prompt exactly and to look it up in the prefix indexes before routing. Chat:
the tokenizer's chat template with the generation prompt, then encoding without special tokens;
completions: a string prompt encoded with special tokens, a token-id list taken as is.
A prompt that cannot be rendered here, or that vLLM would render otherwise (tools, a template
of the request's own, template arguments, no generation prompt: :func:`renders_here`), returns
None (the proxy falls back to estimates; the engine still validates and renders it).

:class:`PromptTokenizer` does the work in whatever process holds it; on the request path that is
a worker of :mod:`proxy.tokenizer_pool`, never the event loop's thread for a long prompt.
:func:`prompt_chars` and :func:`surely_over_context` are the cheap checks made before any of it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.prefix_index import block_keys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptTokens:
    """A prompt as the proxy measured it: its length in tokens and, per block size, the content
    key of each of its full blocks (what the engines' prefix indexes are looked up by)."""

    n_tokens: int
    block_keys: Mapping[int, Sequence[int]]

    def keys(self, block_size: int | None) -> Sequence[int]:
        return self.block_keys.get(block_size, ()) if block_size else ()


@dataclass(frozen=True)
class TokenizerInfo:
    """What the proxy needs to know of the tokenizer to refuse a prompt without tokenizing it.

    ``max_token_chars``: no token stands for more characters of text than this (the longest
    vocabulary entry; byte-level and SentencePiece tokens spell at least one character per
    text character). ``normalizes``: the tokenizer rewrites text first (e.g. NFKC), which may
    shrink it, so the bound gets a margin."""

    max_token_chars: int
    normalizes: bool


#: How much a normalizer may shrink text, at most (composition of combining marks): margin on
#: the character bound when the tokenizer normalizes.
NORMALIZER_MARGIN = 4


def prompt_chars(body: Mapping[str, Any]) -> int:
    """Characters of prompt text in a chat or completions body (non-text parts count 0; a
    token-id prompt counts 4 per id): a cheap size, never more than the text really has."""
    if "messages" in body:
        n = 0
        for m in body["messages"]:
            content = m.get("content") if isinstance(m, Mapping) else None
            if isinstance(content, str):
                n += len(content)
            elif isinstance(content, list):
                n += sum(len(p["text"]) for p in content
                         if isinstance(p, Mapping) and isinstance(p.get("text"), str))
        return n
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, str) else 4 * len(prompt or [])


def surely_over_context(body: Mapping[str, Any], max_model_len: int, info: TokenizerInfo
                        ) -> int | None:
    """A lower bound on the prompt's tokens when it is certainly longer than ``max_model_len``
    (so it can be refused without tokenizing it); None when it may fit (the exact check is then
    the engine's)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        at_least = len(prompt)  # token ids: exact
    else:
        per_token = info.max_token_chars * (NORMALIZER_MARGIN if info.normalizes else 1)
        at_least = -(-prompt_chars(body) // max(1, per_token))
    return at_least if at_least > max_model_len else None


#: The tokenizer classes a model's ``tokenizer_config.json`` can name that are the generic fast
#: tokenizer (``tokenizer.json`` and nothing else): what ``AutoTokenizer`` would build for them.
_GENERIC_FAST = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


class PromptTokenizer:
    def __init__(self, model_dir: str):
        self._tok = load_tokenizer(model_dir)
        self._tok.model_max_length = 1 << 30  # lengths are the engine's to check, not ours

    def info(self) -> TokenizerInfo:
        vocab = self._tok.get_vocab()
        backend = getattr(self._tok, "backend_tokenizer", None)
        return TokenizerInfo(
            max_token_chars=max((len(t) for t in vocab), default=1),
            normalizes=backend is None or backend.normalizer is not None)

    def ids(self, body: Mapping[str, Any]) -> list[int] | None:
        if not renders_here(body):
            return None
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

    def measure(self, body: Mapping[str, Any], block_sizes: Sequence[int]
                ) -> PromptTokens | None:
        """Length and block keys (for each of ``block_sizes``), or None as :meth:`ids`."""
        ids = self.ids(body)
        if ids is None:
            return None
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        return PromptTokens(len(ids), {bs: block_keys(ids, bs, salt) for bs in block_sizes})


#: Chat fields with which vLLM renders a prompt otherwise than from its messages alone.
_RENDERING = ("tools", "documents", "chat_template", "chat_template_kwargs",
              "continue_final_message")


def renders_here(body: Mapping[str, Any]) -> bool:
    """Whether the proxy renders ``body``'s prompt as vLLM's server does: the messages through
    the model's template with the generation prompt and no special tokens added (chat), the
    text with them (completions). Else it is not measured (its characters size it)."""
    if "messages" in body:
        return not any(body.get(k) for k in _RENDERING) and (
            body.get("add_generation_prompt", True) is True
            and body.get("add_special_tokens", False) is False)
    return body.get("add_special_tokens", True) is True


def load_tokenizer(model_dir: str) -> Any:
    """The model's tokenizer, as ``AutoTokenizer`` builds it. A model whose tokenizer is the
    generic fast one is loaded as that class directly: ``AutoTokenizer`` imports transformers'
    model-config machinery and with it torch, 4-5 s of a start here against ~1 s."""
    config = Path(model_dir, "tokenizer_config.json")
    generic = (Path(model_dir, "tokenizer.json").is_file() and config.is_file()
               and json.loads(config.read_text()).get("tokenizer_class") in _GENERIC_FAST)
    if generic:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
