"""Deterministic prompts of a chosen token length for the tiny test model."""

from __future__ import annotations

import random
import threading
from functools import lru_cache

_WORDS = (
    "river stone lantern orbit meadow copper signal harbor velvet thunder quiet maple engine "
    "silver window garden planet shadow marble candle forest bridge violet ember canyon whisper "
    "falcon timber glacier crystal harvest beacon compass mosaic saffron tundra lagoon cobalt"
).split()


_LOAD = threading.Lock()  # transformers' lazy imports are not thread-safe (test load threads)


def _tokenizer(model: str):
    with _LOAD:
        return _load_tokenizer(model)


@lru_cache(maxsize=2)
def _load_tokenizer(model: str):
    from transformers import AutoTokenizer

    from launch.models import ensure_model

    return AutoTokenizer.from_pretrained(str(ensure_model(model)))


def text_of_tokens(n_tokens: int, seed: int, model: str = "tiny") -> str:
    """Text that ``model``'s tokenizer encodes to about ``n_tokens`` tokens."""
    rng = random.Random(seed)
    words = " ".join(rng.choice(_WORDS) for _ in range(n_tokens * 2))
    tok = _tokenizer(model)
    ids = tok.encode(words, add_special_tokens=False)[:n_tokens]
    return tok.decode(ids)
