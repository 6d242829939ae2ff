"""proxy/requests.py: what the proxy refuses before any engine sees it, table-driven."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.errors import (
    ClientError,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    ProxyError,
    UnsupportedMediaType,
    error_body,
)
from proxy.requests import (
    ApiRequest,
    Endpoint,
    check_content_type,
    check_request,
    parse_body,
)

SERVED = {"m", "m-alias"}
LIMIT_BYTES = 1024
#: In a table's changes: remove this key from the base body.
DELETE: Any = object()
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hi"}


def base(endpoint: Endpoint) -> dict[str, Any]:
    return json.loads(json.dumps(CHAT if endpoint == "chat" else COMPLETION))


def check_error(exc: ProxyError, cls: type[ProxyError], param: str | None) -> None:
    assert type(exc) is cls
    assert isinstance(exc, ClientError) and 400 <= exc.status < 500
    assert exc.param == param
    body = error_body(exc)["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["message"] and "Traceback" not in body["message"]


# --- raw body and content type ---------------------------------------------------------------

RAW_BAD: list[tuple[str, bytes, type[ProxyError]]] = [
    ("malformed", b'{"model": "m",', InvalidRequest),
    ("empty", b"", InvalidRequest),
    ("not utf-8", b"\xff\xfe\x00{", InvalidRequest),
    ("array", b"[1, 2]", InvalidRequest),
    ("string", b'"hello"', InvalidRequest),
    ("null", b"null", InvalidRequest),
    ("number", b"5", InvalidRequest),
    ("over limit", b'{"prompt": "' + b"x" * LIMIT_BYTES + b'"}', PayloadTooLarge),
]


@pytest.mark.parametrize(("raw", "cls"), [(r, c) for _, r, c in RAW_BAD],
                         ids=[n for n, _, _ in RAW_BAD])
def test_parse_body_rejects(raw: bytes, cls: type[ProxyError]) -> None:
    with pytest.raises(cls) as info:
        parse_body(raw, LIMIT_BYTES)
    check_error(info.value, cls, None)


def test_payload_too_large_is_413() -> None:
    assert PayloadTooLarge("x").status == 413


def test_parse_body_limit_is_inclusive() -> None:
    raw = b'{"p": "' + b"x" * (LIMIT_BYTES - 9) + b'"}'
    assert len(raw) == LIMIT_BYTES
    assert parse_body(raw, LIMIT_BYTES) == {"p": "x" * (LIMIT_BYTES - 9)}
    with pytest.raises(PayloadTooLarge):
        parse_body(raw + b" ", LIMIT_BYTES)


def test_parse_body_returns_the_object() -> None:
    assert parse_body(json.dumps(CHAT).encode(), LIMIT_BYTES) == CHAT


@pytest.mark.parametrize(
    "content_type",
    [None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
     "application/jsonl", "json"],
)
def test_wrong_content_type(content_type: str | None) -> None:
    with pytest.raises(UnsupportedMediaType) as info:
        check_content_type(content_type)
    assert info.value.status == 415
    check_error(info.value, UnsupportedMediaType, None)


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        " application/json ",
    ],
)
def test_json_content_types_accepted(content_type: str) -> None:
    check_content_type(content_type)


# --- request fields --------------------------------------------------------------------------

# (name, endpoint, changes to the base body, error class, param)
BAD: list[tuple[str, Endpoint, dict[str, Any], type[ProxyError], str | None]] = [
    ("missing messages", "chat", {"messages": DELETE}, InvalidRequest, "messages"),
    ("empty messages", "chat", {"messages": []}, InvalidRequest, "messages"),
    ("messages an object", "chat", {"messages": {"role": "user"}}, InvalidRequest, "messages"),
    ("messages a string", "chat", {"messages": "hi"}, InvalidRequest, "messages"),
    ("message not an object", "chat", {"messages": ["hi"]}, InvalidRequest, "messages"),
    ("message without role", "chat", {"messages": [{"content": "hi"}]}, InvalidRequest,
     "messages"),
    ("role not a string", "chat", {"messages": [{"role": 1, "content": "hi"}]}, InvalidRequest,
     "messages"),
    ("second message bad", "chat",
     {"messages": [{"role": "user", "content": "hi"}, {"role": None}]}, InvalidRequest,
     "messages"),
    # Found by tests/proxy/test_fuzz.py: the other endpoint's prompt field (a 500 before),
    # and prompt lists of what the API does not take.
    ("completions with messages", "completions", {"messages": 5}, InvalidRequest, "messages"),
    ("chat with prompt", "chat", {"prompt": "hi"}, InvalidRequest, "prompt"),
    ("prompt of nulls", "completions", {"prompt": [None]}, InvalidRequest, "prompt"),
    ("prompt of mixed ids and text", "completions", {"prompt": [1, "a"]}, InvalidRequest,
     "prompt"),
    ("prompt with a negative id", "completions", {"prompt": [1, -2]}, InvalidRequest, "prompt"),
    ("prompt with an empty id list", "completions", {"prompt": [[1], []]}, InvalidRequest,
     "prompt"),
    ("prompt with an empty string", "completions", {"prompt": ["a", ""]}, InvalidRequest,
     "prompt"),
    ("prompt ids as floats", "completions", {"prompt": [1.0, 2.0]}, InvalidRequest, "prompt"),
    # Roles and content shapes, as the OpenAI API checks them (the engine accepts more).
    ("unknown role", "chat", {"messages": [{"role": "wizard", "content": "hi"}]},
     InvalidRequest, "messages"),
    ("user content missing", "chat", {"messages": [{"role": "user"}]}, InvalidRequest,
     "messages"),
    ("user content null", "chat", {"messages": [{"role": "user", "content": None}]},
     InvalidRequest, "messages"),
    ("content a number", "chat", {"messages": [{"role": "user", "content": 42}]},
     InvalidRequest, "messages"),
    ("content an object", "chat", {"messages": [{"role": "user", "content": {"text": "x"}}]},
     InvalidRequest, "messages"),
    ("content part without type", "chat",
     {"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, InvalidRequest,
     "messages"),
    ("text part without text", "chat",
     {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, InvalidRequest,
     "messages"),
    ("image part from the system", "chat",
     {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {}}]}]},
     InvalidRequest, "messages"),
    ("tool message without its call id", "chat",
     {"messages": [{"role": "tool", "content": "42"}]}, InvalidRequest, "messages"),
    ("assistant content null without tool calls", "chat",
     {"messages": [{"role": "assistant", "content": None}]}, InvalidRequest, "messages"),
    ("missing prompt", "completions", {"prompt": DELETE}, InvalidRequest, "prompt"),
    ("empty prompt", "completions", {"prompt": ""}, InvalidRequest, "prompt"),
    ("empty prompt list", "completions", {"prompt": []}, InvalidRequest, "prompt"),
    ("prompt a number", "completions", {"prompt": 5}, InvalidRequest, "prompt"),
    ("unknown model", "chat", {"model": "gpt-4"}, ModelNotFound, "model"),
    ("unknown model (completions)", "completions", {"model": "M"}, ModelNotFound, "model"),
    ("model not a string", "chat", {"model": ["m"]}, InvalidRequest, "model"),
    ("stream a string", "chat", {"stream": "true"}, InvalidRequest, "stream"),
    ("stream an int", "chat", {"stream": 1}, InvalidRequest, "stream"),
    ("stream 0", "completions", {"stream": 0}, InvalidRequest, "stream"),
    ("max_tokens 0", "chat", {"max_tokens": 0}, InvalidRequest, "max_tokens"),
    ("max_tokens -1", "chat", {"max_tokens": -1}, InvalidRequest, "max_tokens"),
    ("max_tokens string", "chat", {"max_tokens": "5"}, InvalidRequest, "max_tokens"),
    ("max_tokens bool", "chat", {"max_tokens": True}, InvalidRequest, "max_tokens"),
    ("max_tokens float", "completions", {"max_tokens": 5.0}, InvalidRequest, "max_tokens"),
    ("max_completion_tokens 0", "chat", {"max_completion_tokens": 0}, InvalidRequest,
     "max_completion_tokens"),
    ("temperature negative", "chat", {"temperature": -0.1}, InvalidRequest, "temperature"),
    ("temperature too high", "chat", {"temperature": 2.5}, InvalidRequest, "temperature"),
    ("temperature NaN", "chat", {"temperature": float("nan")}, InvalidRequest, "temperature"),
    ("temperature inf", "chat", {"temperature": float("inf")}, InvalidRequest, "temperature"),
    ("temperature string", "chat", {"temperature": "0.5"}, InvalidRequest, "temperature"),
    ("temperature bool", "chat", {"temperature": True}, InvalidRequest, "temperature"),
    ("top_p 0", "chat", {"top_p": 0}, InvalidRequest, "top_p"),
    ("top_p over 1", "chat", {"top_p": 1.01}, InvalidRequest, "top_p"),
    ("top_p NaN", "completions", {"top_p": float("nan")}, InvalidRequest, "top_p"),
    ("n=2", "chat", {"n": 2}, InvalidRequest, "n"),
    ("n=0", "completions", {"n": 0}, InvalidRequest, "n"),
    ("stream_options without stream", "chat", {"stream_options": {"include_usage": True}},
     InvalidRequest, "stream_options"),
    ("stream_options with stream false", "completions",
     {"stream": False, "stream_options": {"include_usage": True}}, InvalidRequest,
     "stream_options"),
    ("client kv_transfer_params", "chat",
     {"kv_transfer_params": {"remote_host": "169.254.169.254", "do_remote_prefill": True}},
     InvalidRequest, "kv_transfer_params"),
    ("client kv_transfer_params null", "completions", {"kv_transfer_params": None},
     InvalidRequest, "kv_transfer_params"),
    # What only the decode engine would refuse (the prefill body drops or sets it): after a
    # whole remote prefill, were it not checked here.
    ("stream_options not an object", "chat", {"stream": True, "stream_options": "yes"},
     InvalidRequest, "stream_options"),
    ("stream_options of a non-boolean", "chat",
     {"stream": True, "stream_options": {"include_usage": "yes"}}, InvalidRequest,
     "stream_options"),
    ("return_token_ids not a boolean", "completions", {"return_token_ids": "please"},
     InvalidRequest, "return_token_ids"),
    ("min_tokens over max_tokens", "chat", {"max_tokens": 4, "min_tokens": 5}, InvalidRequest,
     "min_tokens"),
    ("min_tokens negative", "completions", {"min_tokens": -1}, InvalidRequest, "min_tokens"),
    ("prompt_logprobs streamed", "completions", {"stream": True, "prompt_logprobs": 1},
     InvalidRequest, "prompt_logprobs"),
    ("frequency_penalty over 2", "chat", {"frequency_penalty": 3}, InvalidRequest,
     "frequency_penalty"),
    ("presence_penalty under -2", "chat", {"presence_penalty": -2.5}, InvalidRequest,
     "presence_penalty"),
    ("max_tokens past int64", "chat", {"max_tokens": 2**63}, InvalidRequest, "max_tokens"),
]


def apply(body: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    for key, value in changes.items():
        if value is DELETE:
            del body[key]
        else:
            body[key] = value
    return body


@pytest.mark.parametrize(
    ("endpoint", "changes", "cls", "param"),
    [(e, ch, c, p) for _, e, ch, c, p in BAD],
    ids=[n for n, *_ in BAD],
)
def test_bad_requests(
    endpoint: Endpoint, changes: dict[str, Any], cls: type[ProxyError], param: str | None
) -> None:
    body = apply(base(endpoint), changes)
    with pytest.raises(ProxyError) as info:
        check_request(endpoint, body, SERVED)
    check_error(info.value, cls, param)


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "prompt": "hi", "temperature": NaN}',  # Python's json would accept these
    b'{"model": "m", "prompt": "hi", "logit_bias": {"1": Infinity}}',
    b'{"model": "m", "prompt": "hi", "top_p": 1e400}',
    b'{"model": "m", "prompt": "\\ud800"}',  # a lone surrogate: not encodable again
    b'{"model": "m", "prompt": "\xff"}',  # not UTF-8
])
def test_only_strict_json_is_accepted(raw: bytes) -> None:
    """Whatever is parsed is passed on to engines re-encoded; what cannot be is refused."""
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_body(raw, LIMIT_BYTES)


def test_strictly_parsed_bodies_round_trip() -> None:
    from proxy.engine_client import _dumps

    raw = '{"model":"m","prompt":"h\u00e9 ✓","max_tokens":3,"temperature":0.1,"n":1}'.encode()
    body = parse_body(raw, LIMIT_BYTES)
    assert body["prompt"] == "hé ✓"
    assert parse_body(_dumps(body), LIMIT_BYTES) == body


@pytest.mark.parametrize("messages", [
    [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
      "tool_calls": [{"id": "c1", "type": "function",
                      "function": {"name": "f", "arguments": "{}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "42"}],
    [{"role": "user", "content": "weather?"},  # the deprecated function call
     {"role": "assistant", "content": None,
      "function_call": {"name": "get_weather", "arguments": "{}"}},
     {"role": "function", "name": "get_weather", "content": "sunny"}],
    [{"role": "user", "content": "x"},
     {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
     {"role": "user", "content": "ok"}],
])
def test_good_chat_shapes_pass(messages) -> None:
    assert check_request("chat", dict(base("chat"), messages=messages), SERVED) is False


def test_client_params_checked_before_anything_else() -> None:
    """Even an otherwise broken body is refused for its kv_transfer_params first."""
    body = {"model": "nope", "kv_transfer_params": {}}
    with pytest.raises(InvalidRequest) as info:
        check_request("chat", body, SERVED)
    assert info.value.param == "kv_transfer_params"


GOOD: list[tuple[str, Endpoint, dict[str, Any], bool]] = [
    ("chat minimal", "chat", {}, False),
    ("chat no model", "chat", {"model": None}, False),
    ("chat alias", "chat", {"model": "m-alias"}, False),
    ("chat stream", "chat", {"stream": True}, True),
    ("chat stream false", "chat", {"stream": False}, False),
    ("chat stream_options", "chat", {"stream": True, "stream_options": {"include_usage": True}},
     True),
    ("completions minimal", "completions", {}, False),
    ("completions stream", "completions", {"stream": True}, True),
    ("prompt token ids", "completions", {"prompt": [1, 2, 3]}, False),
    ("prompt list of strings", "completions", {"prompt": ["a", "b"]}, False),
    ("sampling edges", "chat",
     {"max_tokens": 1, "max_completion_tokens": 1, "temperature": 0, "top_p": 1, "n": 1}, False),
    ("sampling upper edges", "completions", {"temperature": 2.0, "top_p": 0.01}, False),
    ("nulls are unset", "chat", {"max_tokens": None, "temperature": None, "top_p": None}, False),
    ("stream null is unset", "chat", {"stream": None}, False),
    ("min_tokens up to max_tokens", "chat", {"max_tokens": 4, "min_tokens": 4}, False),
    ("penalties at their edges", "chat", {"frequency_penalty": -2, "presence_penalty": 2.0},
     False),
    ("extra fields pass", "chat", {"seed": 1, "logprobs": True, "tools": []}, False),
    ("prompt a list of strings", "completions", {"prompt": ["a", "b"]}, False),
    ("prompt token ids", "completions", {"prompt": [0, 5, 7]}, False),
    ("prompt lists of token ids", "completions", {"prompt": [[1, 2], [3]]}, False),
    ("any message role string", "chat",
     {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}, False),
]


@pytest.mark.parametrize(
    ("endpoint", "changes", "stream"),
    [(e, ch, s) for _, e, ch, s in GOOD],
    ids=[n for n, *_ in GOOD],
)
def test_good_requests_return_the_stream_flag(
    endpoint: Endpoint, changes: dict[str, Any], stream: bool
) -> None:
    body = apply(base(endpoint), changes)
    before = json.loads(json.dumps(body))
    assert check_request(endpoint, body, SERVED) is stream
    assert body == before  # checking never rewrites the client's body


def test_api_request_path() -> None:
    assert ApiRequest("chat", CHAT, False, "r").path == "/v1/chat/completions"
    assert ApiRequest("completions", COMPLETION, True, "r").path == "/v1/completions"


def test_engine_replies_that_are_not_strict_json_still_parse() -> None:
    """Engine output is not ours to police: a reply with a NaN literal falls back to json."""
    import math

    from proxy.engine_client import EngineReply

    assert EngineReply(200, b'{"a": [1, 2]}').json() == {"a": [1, 2]}
    assert math.isnan(EngineReply(200, b'{"a": NaN}').json()["a"])
