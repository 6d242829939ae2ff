"""Parse and check a client's request before any engine sees it.

Everything rejected here gets a 4xx with an OpenAI-style body and costs the engines nothing. The
checks are the ones the proxy must own (wire safety, limits it enforces); the engine still
validates the rest (e.g. a prompt longer than the context) and its 4xx is passed on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from proxy.errors import InvalidRequest, ModelNotFound, PayloadTooLarge, UnsupportedMediaType
from proxy.policy import Targets
from transport import kv_params

if TYPE_CHECKING:  # imported only when tracing is on (it loads the OpenTelemetry SDK)
    from proxy.tracing import RequestSpans

Endpoint = Literal["chat", "completions"]
PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class ApiRequest:
    endpoint: Endpoint
    body: dict[str, Any]
    stream: bool
    request_id: str
    #: Set only by the proxy itself (start-up probes, benchmarks via the admin API): skip the
    #: policy and take this route.
    force_route: Literal["disaggregated", "local"] | None = None
    #: The client's per-request KV limits (``kv_limits``), already taken out of ``body``.
    kv_limits: kv_params.KVLimits | None = None
    #: The client's own latency targets (``slo``), already taken out of ``body``.
    targets: Targets | None = None
    #: This request's trace (``proxy/tracing.py``); None when tracing is off.
    spans: RequestSpans | None = None
    #: When the whole request must be over, in the event loop's clock (``loop.time()``): set
    #: at arrival from ``--total-deadline-s`` and kept by every retry and continuation (None:
    #: the orchestrator sets it when serving starts).
    deadline: float | None = None

    @property
    def path(self) -> str:
        return PATHS[self.endpoint]


def take_kv_limits(body: dict[str, Any]) -> kv_params.KVLimits | None:
    """Remove and validate the client's ``kv_limits`` (the engines get them translated)."""
    if kv_params.LIMITS_KEY not in body:
        return None
    try:
        return kv_params.parse_limits(body.pop(kv_params.LIMITS_KEY))
    except ValueError as exc:
        raise InvalidRequest(str(exc), param=kv_params.LIMITS_KEY) from None


#: pdserve's request field for the client's latency targets (never forwarded to an engine).
SLO_KEY = "slo"
_SLO_FIELDS = {"ttft_ms": "ttft_s", "itl_ms": "itl_s"}
_MAX_TARGET_MS = 1e7


def take_slo(body: dict[str, Any]) -> Targets | None:
    """Remove and validate the client's ``slo``: ``{"ttft_ms": N, "itl_ms": N}``, each optional,
    each a positive number of milliseconds."""
    if SLO_KEY not in body:
        return None
    raw = body.pop(SLO_KEY)
    if not isinstance(raw, dict):
        raise InvalidRequest("slo must be an object", param=SLO_KEY)
    unknown = sorted(set(raw) - set(_SLO_FIELDS))
    if unknown:
        raise InvalidRequest(f"slo has unsupported keys: {', '.join(unknown)}", param=SLO_KEY)
    seconds: dict[str, float] = {}
    for key, attr in _SLO_FIELDS.items():
        if key in raw:
            v = raw[key]
            if not _is_number(v) or not 0 < v <= _MAX_TARGET_MS:
                raise InvalidRequest(f"slo.{key} must be a number of milliseconds in "
                                     f"(0, {_MAX_TARGET_MS:g}]", param=SLO_KEY)
            seconds[attr] = v / 1e3
    return Targets(**seconds) if seconds else None


def check_content_type(content_type: str | None) -> None:
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {media or 'none'!r}"
        )


def parse_body(raw: bytes, limit_bytes: int) -> dict[str, Any]:
    if len(raw) > limit_bytes:
        raise PayloadTooLarge(f"request body is over the {limit_bytes} byte limit")
    try:
        # Strict JSON (RFC 8259): no NaN/Infinity literals, no lone surrogates, UTF-8 only;
        # so every body passed on can be encoded again as is (engine_client uses msgspec too).
        body = msgspec.json.decode(raw)
    except (ValueError, UnicodeDecodeError):  # msgspec.DecodeError is a ValueError
        raise InvalidRequest("request body is not valid JSON") from None
    except RecursionError:  # a small body of deeply nested arrays or objects
        raise InvalidRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


#: The roles of the OpenAI chat API (``function`` is its deprecated form of ``tool``).
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
#: Content part types per role; text everywhere, media only from the user.
_PART_TYPES = {"user": ("text", "image_url", "input_audio", "video_url", "file"),
               "assistant": ("text", "refusal")}


def check_message(i: int, m: Any) -> None:
    """One chat message, as the OpenAI API checks it: a known role; content a string or a list
    of typed parts (``text`` parts with a string ``text``); content may be absent or null only
    for an assistant message that calls tools (or a function: the deprecated form); a tool
    message names its call."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequest(f"{where} must be an object", param="messages")
    role = m.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}",
                             param="messages")
    content = m.get("content")
    if content is None:
        if role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
            return
        raise InvalidRequest(f"{where}.content is required", param="messages")
    if isinstance(content, str):
        pass
    elif isinstance(content, list):
        allowed = _PART_TYPES.get(role, ("text",))
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in allowed:
                raise InvalidRequest(f"{where}.content[{j}].type must be one of "
                                     f"{', '.join(allowed)} for role {role}", param="messages")
            if kind == "text" and not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}.content[{j}].text must be a string",
                                     param="messages")
    else:
        raise InvalidRequest(f"{where}.content must be a string or a list of parts",
                             param="messages")
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise InvalidRequest(f"{where}.tool_call_id is required for role tool",
                             param="messages")


def is_batch(body: Mapping[str, Any]) -> bool:
    """A completions request of several prompts. vLLM's prefill reply carries the first one's
    hand-off only: a batch is computed where it is decoded."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and not _is_int(prompt[0])


def check_prompt(prompt: Any) -> None:
    """A completions prompt as the OpenAI API takes it: a string, a list of strings, a list of
    token ids, or a list of lists of token ids; none of them empty."""
    def ids(xs: Any) -> bool:
        return isinstance(xs, list) and bool(xs) and all(_is_int(x) and x >= 0 for x in xs)

    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        return
    if not (isinstance(prompt, list) and prompt):
        raise InvalidRequest("prompt must be a non-empty string or list", param="prompt")
    if all(isinstance(p, str) and p for p in prompt) or ids(prompt) or all(
            ids(p) for p in prompt):
        return
    raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids or "
                         "a list of lists of token ids", param="prompt")


def check_decode_only(body: Mapping[str, Any], stream: bool) -> None:
    """Fields the prefill body drops or sets itself (``engine_bodies.prefill_body``): only the
    decode engine would refuse them, after a whole remote prefill. Checked here instead."""
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and all(
            v is None or isinstance(v, bool) for v in options.values())):
        raise InvalidRequest("stream_options must be an object of booleans",
                             param="stream_options")
    if not isinstance(body.get("return_token_ids", False), (bool, type(None))):
        raise InvalidRequest("return_token_ids must be a boolean", param="return_token_ids")
    least = body.get("min_tokens")
    if least is not None:
        most = [v for k in ("max_tokens", "max_completion_tokens") if _is_int(v := body.get(k))]
        if not _is_int(least) or least < 0 or any(least > v for v in most):
            raise InvalidRequest("min_tokens must be an integer from 0 to max_tokens",
                                 param="min_tokens")
    wanted = body.get("prompt_logprobs")
    if stream and isinstance(wanted, int) and (wanted > 0 or wanted == -1):
        raise InvalidRequest("prompt_logprobs are not available when stream=true",
                             param="prompt_logprobs")
    for key in ("frequency_penalty", "presence_penalty"):
        v = body.get(key)
        if v is not None and (not _is_number(v) or not -2 <= v <= 2):
            raise InvalidRequest(f"{key} must be a number in [-2, 2]", param=key)


def check_request(endpoint: Endpoint, body: dict[str, Any], served_models: set[str]) -> bool:
    """Validate ``body`` for ``endpoint``; return whether it asks for a stream."""
    if (field := kv_params.client_params(body)) is not None:
        raise InvalidRequest(
            "transfer params (kv_transfer_params, ec_transfer_params) are set by the server "
            "and may not be sent by clients", param=field)
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise InvalidRequest("model must be a string", param="model")
        if model not in served_models:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    # Each endpoint's prompt field and no other: what reads a body's prompt goes by the key
    # it finds, so a completions body with "messages" must not get that far.
    foreign = "prompt" if endpoint == "chat" else "messages"
    if foreign in body:
        raise InvalidRequest(
            f"{foreign} is not a field of /v1/{'chat/' if endpoint == 'chat' else ''}"
            f"completions (it takes {'messages' if endpoint == 'chat' else 'prompt'})",
            param=foreign)
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            check_message(i, m)
    else:
        check_prompt(body.get("prompt"))
    stream = body.get("stream")
    if stream is None:  # (null is unset, as OpenAI and vLLM take it)
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", param="stream")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not _is_int(v) or not 1 <= v < 2**63):
            raise InvalidRequest(f"{key} must be a positive integer", param=key)
    check_decode_only(body, stream)
    t = body.get("temperature")
    if t is not None and (not _is_number(t) or not 0 <= t <= 2):
        raise InvalidRequest("temperature must be a number in [0, 2]", param="temperature")
    p = body.get("top_p")
    if p is not None and (not _is_number(p) or not 0 < p <= 1):
        raise InvalidRequest("top_p must be a number in (0, 1]", param="top_p")
    n = body.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        raise InvalidRequest("only n=1 is supported", param="n")
    if body.get("stream_options") is not None and not stream:
        raise InvalidRequest("stream_options is only allowed with stream=true",
                             param="stream_options")
    return stream
