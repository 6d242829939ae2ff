"""Every body the proxy sends an engine, made from the client's request here and nowhere else.

The client's parsed body is never changed: each function returns a new dict (shallow copies:
the message list and the prompt are shared, never mutated). The ``kv_transfer_params`` inside
come from ``transport.kv_params``, their one owner.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transport import kv_params

#: Output budget assumed for a request that sets no max_tokens (routing load only).
DEFAULT_OUTPUT_BUDGET = 256


def output_budget(body: Mapping[str, Any]) -> int:
    """The most tokens the request may generate (its max_tokens), for the decode load."""
    stated = stated_output_budget(body)
    return DEFAULT_OUTPUT_BUDGET if stated is None else stated


def stated_output_budget(body: Mapping[str, Any]) -> int | None:
    """The request's own max_tokens (None: it set none): a chat request's
    ``max_completion_tokens`` when set, else its ``max_tokens``; a completion's ``max_tokens``
    (vLLM reads no other there)."""
    keys = ("max_completion_tokens", "max_tokens") if "messages" in body else ("max_tokens",)
    return next((body[k] for k in keys if isinstance(body.get(k), int)), None)


def prefill_body(body: Mapping[str, Any], limits: kv_params.KVLimits | None = None
                 ) -> dict[str, Any]:
    """The client's request cut down to a prefill: one token, no stream, ids returned."""
    out = dict(body)
    out["max_tokens"] = 1
    out.pop("max_completion_tokens", None)
    out.pop("min_tokens", None)  # (vLLM refuses min_tokens over max_tokens)
    out["stream"] = False
    out.pop("stream_options", None)
    out["return_token_ids"] = True
    out[kv_params.BODY_KEY] = kv_params.with_limits(kv_params.prefill_request_params(), limits)
    return out


def decode_body(body: Mapping[str, Any], handoff: kv_params.PrefillHandoff | None,
                read_by: float, limits: kv_params.KVLimits | None = None) -> dict[str, Any]:
    """The client's request for the decode engine: with the hand-off (pull the KV, if the engine
    gets to it by ``read_by``, unix seconds) or without (compute the prompt), plus the client's
    KV limits either way."""
    out = dict(body)
    params = (kv_params.decode_request_params(handoff, read_by=read_by, raw_ids=True)
              if handoff is not None else None)
    if (params := kv_params.with_limits(params, limits)) is not None:
        out[kv_params.BODY_KEY] = params
    return out


def release_body(decode: Mapping[str, Any]) -> dict[str, Any]:
    """A one-token, unstreamed copy of a decode body: reading the hand-off's blocks frees them
    on the prefill engine (for a client that left before its decode request got out)."""
    out = dict(decode, max_tokens=1, stream=False)
    out.pop("max_completion_tokens", None)
    out.pop("min_tokens", None)
    out.pop("stream_options", None)
    return out
