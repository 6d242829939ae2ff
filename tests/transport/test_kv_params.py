"""transport/kv_params.py: the one owner of the ``kv_transfer_params`` wire format."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import pytest

from transport import kv_params
from transport.kv_params import (
    HandoffError,
    PrefillHandoff,
    decode_request_params,
    has_client_params,
    parse_prefill_json,
    parse_prefill_reply,
    prefill_request_params,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
#: A 37-token chat prompt (the params below: 16 of its tokens were cached on the prefill).
PROMPT_IDS = [151644, 872, 198, *[9707, 11, 1879, 0] * 8, 151645, 198]


def nixl_params(**overrides: Any) -> dict[str, Any]:
    """What vLLM 0.32's NixlConnector (pull mode) puts on a finished prefill's reply."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[3, 4, 5], [9]],
        "remote_engine_id": "0b7c6f0e-prefill-engine",
        "remote_request_id": "chatcmpl-req-42-0-9f1c",
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 37,
        "remote_blocks_expiry_time": 18234.625,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 16,
    }
    params.update(overrides)
    return params


def chat_reply(params: Any = None, **top: Any) -> dict[str, Any]:
    """A vLLM 0.32 /v1/chat/completions reply to a prefill request (max_tokens=1, ids returned)."""
    reply: dict[str, Any] = {
        "id": "chatcmpl-req-42",
        "object": "chat.completion",
        "created": 1767225600,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello", "tool_calls": []},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": [9707],
            }
        ],
        "usage": {"prompt_tokens": 37, "total_tokens": 38, "completion_tokens": 1},
        "prompt_logprobs": None,
        "prompt_token_ids": list(PROMPT_IDS),
        "kv_transfer_params": nixl_params() if params is None else params,
    }
    reply.update(top)
    return reply


def completions_reply(params: Any = None) -> dict[str, Any]:
    """A /v1/completions reply: the prompt ids live on the choice, not at the top level."""
    return {
        "id": "cmpl-req-43",
        "object": "text_completion",
        "created": 1767225600,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": " the",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
                "prompt_token_ids": list(PROMPT_IDS),
                "token_ids": [279],
            }
        ],
        "usage": {"prompt_tokens": 37, "total_tokens": 38, "completion_tokens": 1},
        "kv_transfer_params": nixl_params() if params is None else params,
    }


# --- parse_prefill_reply -------------------------------------------------------------------


def test_parse_chat_reply() -> None:
    handoff = parse_prefill_reply(chat_reply())
    assert handoff.engine_id == "0b7c6f0e-prefill-engine"
    assert handoff.request_id == "chatcmpl-req-42-0-9f1c"
    assert handoff.host == "10.0.0.7"
    assert handoff.port == 5600
    assert handoff.num_blocks == 4  # summed over KV cache groups
    assert handoff.has_blocks
    assert handoff.num_tokens == 37
    assert handoff.cached_tokens == 16
    assert handoff.prompt_token_ids == tuple(PROMPT_IDS)
    assert dict(handoff.params) == nixl_params()


def test_parse_completions_reply_reads_ids_from_the_choice() -> None:
    handoff = parse_prefill_reply(completions_reply())
    assert handoff.prompt_token_ids == tuple(PROMPT_IDS)
    assert handoff.request_id == "chatcmpl-req-42-0-9f1c"


def test_top_level_null_ids_fall_back_to_the_choice() -> None:
    reply = completions_reply()
    reply["prompt_token_ids"] = None
    assert parse_prefill_reply(reply).prompt_token_ids == tuple(PROMPT_IDS)


def test_optional_counts_default_to_zero() -> None:
    params = nixl_params()
    for key in ("remote_num_tokens", "remote_prefill_cached_tokens"):
        del params[key]
    handoff = parse_prefill_reply(chat_reply(params))
    assert (handoff.num_tokens, handoff.cached_tokens) == (0, 0)


def test_no_blocks() -> None:
    handoff = parse_prefill_reply(chat_reply(nixl_params(remote_block_ids=[[]])))
    assert handoff.num_blocks == 0
    assert not handoff.has_blocks


def test_null_block_id_and_empty_groups_are_accepted() -> None:
    """vLLM's null block is id 0; a full prefix hit on the prefill leaves no blocks at all."""
    assert parse_prefill_reply(chat_reply(nixl_params(remote_block_ids=[[0, 3], []]))
                               ).num_blocks == 2
    assert parse_prefill_reply(chat_reply(nixl_params(remote_block_ids=[]))).num_blocks == 0


def test_every_prompt_token_cached_is_accepted() -> None:
    params = nixl_params(remote_prefill_cached_tokens=len(PROMPT_IDS))
    assert parse_prefill_reply(chat_reply(params)).cached_tokens == len(PROMPT_IDS)


def test_ids_up_to_int64_are_accepted() -> None:
    """The int64 check only decodes ids long enough to need it; the largest that fits passes."""
    ids = [*PROMPT_IDS, 2**63 - 1, 10**18]
    reply = chat_reply(prompt_token_ids=ids)
    assert parse_prefill_json(msgspec.json.encode(reply)).prompt_token_ids == tuple(ids)
    assert parse_prefill_reply(reply).prompt_token_ids == tuple(ids)


def test_handoff_is_frozen_and_independent_of_the_reply() -> None:
    reply = chat_reply()
    handoff = parse_prefill_reply(reply)
    with pytest.raises(dataclasses.FrozenInstanceError):
        handoff.port = 1  # type: ignore[misc]
    reply["kv_transfer_params"]["remote_host"] = "evil.example"
    reply["kv_transfer_params"]["injected"] = True
    reply["prompt_token_ids"].append(7)
    assert handoff.params["remote_host"] == "10.0.0.7"
    assert "injected" not in handoff.params
    assert handoff.prompt_token_ids == tuple(PROMPT_IDS)


def _without(key: str) -> dict[str, Any]:
    params = nixl_params()
    del params[key]
    return params


def _reply_without_ids() -> dict[str, Any]:
    reply = chat_reply()
    del reply["prompt_token_ids"]
    return reply


def _completions_without_choice_ids() -> dict[str, Any]:
    reply = completions_reply()
    del reply["choices"][0]["prompt_token_ids"]
    return reply


BAD_REPLIES: list[tuple[str, Any]] = [
    ("null params", chat_reply() | {"kv_transfer_params": None}),
    ("params missing", {k: v for k, v in chat_reply().items() if k != "kv_transfer_params"}),
    ("params not an object", chat_reply(params=["remote_host"])),
    ("params empty", chat_reply(params={})),
    *[(f"missing {k}", chat_reply(_without(k))) for k in (
        "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids",
    )],
    ("null remote_host", chat_reply(nixl_params(remote_host=None))),
    ("null remote_block_ids", chat_reply(nixl_params(remote_block_ids=None))),
    ("no ids anywhere", _reply_without_ids()),
    ("completions choice without ids", _completions_without_choice_ids()),
    ("empty ids", chat_reply(prompt_token_ids=[])),
    ("ids not a list", chat_reply(prompt_token_ids="1 2 3")),
    ("ids not ints", chat_reply(prompt_token_ids=[1, "2", 3])),
    ("ids contain a float", chat_reply(prompt_token_ids=[1, 2.0])),
    ("ids contain a bool", chat_reply(prompt_token_ids=[1, True])),
    ("port not a number", chat_reply(nixl_params(remote_port="not-a-port"))),
    ("port empty string", chat_reply(nixl_params(remote_port=""))),
    ("port a list", chat_reply(nixl_params(remote_port=[5600]))),
    # What the decode engine acts on is checked against what vLLM's NixlConnector writes
    # (pull_scheduler.request_finished): a string host, an int port, int block ids, ...
    ("port a numeric string", chat_reply(nixl_params(remote_port="5601"))),
    ("port a bool", chat_reply(nixl_params(remote_port=True))),
    ("port a float", chat_reply(nixl_params(remote_port=5600.5))),
    ("port negative", chat_reply(nixl_params(remote_port=-1))),
    ("port zero", chat_reply(nixl_params(remote_port=0))),
    ("port over 65535", chat_reply(nixl_params(remote_port=70000))),
    ("host an object", chat_reply(nixl_params(remote_host={"a": 1}))),
    ("host a list", chat_reply(nixl_params(remote_host=["10.0.0.7", "169.254.169.254"]))),
    ("host empty", chat_reply(nixl_params(remote_host=""))),
    ("engine id a number", chat_reply(nixl_params(remote_engine_id=7))),
    ("request id an object", chat_reply(nixl_params(remote_request_id={"id": "r"}))),
    ("block ids strings", chat_reply(nixl_params(remote_block_ids=[["a", None]]))),
    ("block ids negative", chat_reply(nixl_params(remote_block_ids=[[-5, 2]]))),
    ("block ids bools", chat_reply(nixl_params(remote_block_ids=[[True]]))),
    ("block ids floats", chat_reply(nixl_params(remote_block_ids=[[3.0]]))),
    ("do_remote_prefill false", chat_reply(nixl_params(do_remote_prefill=False))),
    ("do_remote_prefill missing", chat_reply(_without("do_remote_prefill"))),
    ("do_remote_prefill truthy", chat_reply(nixl_params(do_remote_prefill=1))),
    ("cached more than the prompt", chat_reply(nixl_params(remote_prefill_cached_tokens=10**9))),
    ("cached negative", chat_reply(nixl_params(remote_prefill_cached_tokens=-1))),
    ("num_tokens negative", chat_reply(nixl_params(remote_num_tokens=-3))),
    ("num_tokens a bool", chat_reply(nixl_params(remote_num_tokens=True))),
    ("ids over int64", chat_reply(prompt_token_ids=[1, 2**63])),
    ("ids far over int64", chat_reply(prompt_token_ids=[2**70])),
    # Malformed shapes must also be a HandoffError (the proxy falls back on it), not a crash.
    ("reply is a list", [chat_reply()]),
    ("reply is null", None),
    ("choices not a list of objects", _reply_without_ids() | {"choices": ["x"]}),
    ("choices a string", _reply_without_ids() | {"choices": "x"}),
    ("block ids a flat list", chat_reply(nixl_params(remote_block_ids=[3, 4, 5]))),
    ("block ids a string", chat_reply(nixl_params(remote_block_ids="3,4,5"))),
    ("num_tokens not a number", chat_reply(nixl_params(remote_num_tokens="many"))),
    ("cached tokens not a number", chat_reply(nixl_params(remote_prefill_cached_tokens=[1]))),
]


@pytest.mark.parametrize("reply", [r for _, r in BAD_REPLIES], ids=[n for n, _ in BAD_REPLIES])
def test_bad_replies_raise_handoff_error(reply: Any) -> None:
    with pytest.raises(HandoffError):
        parse_prefill_reply(reply)


def test_handoff_error_is_a_value_error() -> None:
    assert issubclass(HandoffError, ValueError)


@pytest.mark.parametrize("reply", [r for _, r in BAD_REPLIES], ids=[n for n, _ in BAD_REPLIES])
def test_bad_reply_bytes_raise_handoff_error(reply: Any) -> None:
    """The hot path (the reply's bytes, ids kept raw) refuses exactly what the dict path does."""
    with pytest.raises(HandoffError):
        parse_prefill_json(msgspec.json.encode(reply))


@pytest.mark.parametrize("make", [chat_reply, completions_reply])
def test_reply_bytes_give_the_same_handoff(make) -> None:
    raw = parse_prefill_json(msgspec.json.encode(make()))
    assert raw == parse_prefill_reply(make())
    assert raw.num_prompt_tokens == len(PROMPT_IDS)
    assert raw.prompt_token_ids == tuple(PROMPT_IDS)


@pytest.mark.parametrize("text", [b"[]", b"[ ]", b"[-1]", b"[1.5]", b'["1"]', b"null",
                                  b"[true]", b"{}", b"1", b"[[1]]", b"[1e3]"])
def test_token_id_scan_refuses_anything_but_a_list_of_ids(text: bytes) -> None:
    with pytest.raises(HandoffError):
        kv_params.count_token_ids(text)


@pytest.mark.parametrize("ids", [b"[1,,2]", b"[1,]", b"[,1]", b"[1 2]"])
def test_malformed_id_json_never_reaches_the_scan(ids: bytes) -> None:
    """The scan relies on well-formed JSON; the reply's decoder refuses anything else."""
    reply = msgspec.json.encode(chat_reply(prompt_token_ids=None))
    reply = reply.replace(b'"prompt_token_ids":null', b'"prompt_token_ids":' + ids)
    with pytest.raises(HandoffError):
        parse_prefill_json(reply)


def test_token_id_scan_counts() -> None:
    assert kv_params.count_token_ids(b"[ 1, 22,\n333 ]") == 3
    assert kv_params.count_token_ids(b"[7]") == 1


# --- decode_request_params -------------------------------------------------------------------


def _as_sent(params: dict[str, Any]) -> Any:
    """``params`` the way a decode engine receives them (msgspec encodes every engine body)."""
    return msgspec.json.decode(msgspec.json.encode(params))


def test_decode_params_are_the_prefill_params_plus_prompt_ids() -> None:
    handoff = parse_prefill_reply(chat_reply())
    params = decode_request_params(handoff)
    assert params == nixl_params() | {"prompt_token_ids": PROMPT_IDS}
    assert isinstance(params["prompt_token_ids"], list)  # JSON-ready, not a tuple
    raw = decode_request_params(handoff, raw_ids=True)
    assert _as_sent(raw) == params
    # The proxy's way: the prefill's JSON spliced verbatim, never turned into Python ints.
    assert isinstance(raw["prompt_token_ids"], msgspec.Raw)


def test_unknown_keys_pass_through_verbatim() -> None:
    extra = {"future_key": {"nested": [1, 2]}, "remote_pcp_size": 2, "weird": None}
    handoff = parse_prefill_reply(chat_reply(nixl_params(**extra)))
    params = _as_sent(decode_request_params(handoff))
    for key, value in extra.items():
        assert key in params and params[key] == value


def test_decode_params_do_not_mutate_the_handoff() -> None:
    handoff = parse_prefill_reply(chat_reply())
    before = copy.deepcopy(dict(handoff.params))
    params = decode_request_params(handoff)
    assert "prompt_token_ids" not in handoff.params
    params["remote_host"] = "elsewhere"
    params["prompt_token_ids"] = [1]
    assert dict(handoff.params) == before
    assert handoff.prompt_token_ids == tuple(PROMPT_IDS)
    # Asking twice gives the same answer.
    assert _as_sent(decode_request_params(handoff)) == nixl_params() | {
        "prompt_token_ids": PROMPT_IDS}


def test_decode_params_from_a_constructed_handoff() -> None:
    handoff = PrefillHandoff(
        engine_id="e", request_id="r", host="h", port=1, num_blocks=0, num_tokens=0,
        cached_tokens=0, prompt_token_ids_json=b"[5,6]", num_prompt_tokens=2, params={"k": "v"},
    )
    assert _as_sent(decode_request_params(handoff)) == {"k": "v", "prompt_token_ids": [5, 6]}


# --- prefill_request_params / has_client_params -----------------------------------------------


def test_prefill_request_params() -> None:
    params = prefill_request_params()
    assert params["do_remote_decode"] is True
    assert params["do_remote_prefill"] is False
    assert prefill_request_params() is not params  # a fresh dict each call: safe to mutate


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"model": "m", "messages": []}, False),
        ({"kv_transfer_params": {"remote_host": "169.254.169.254"}}, True),
        ({"kv_transfer_params": None}, True),  # present at all is refused
        ({"kv_transfer": {}}, False),
        ({}, False),
        ({"ec_transfer_params": {}}, True),
        ({"vllm_xargs": {"kv_transfer_params": ""}}, True),  # vLLM's extra_args: the engine's
        ({"vllm_xargs": {"ec_transfer_params": [1]}}, True),
        ({"vllm_xargs": {"kv_cache_report_mode": "full"}}, False),
        ({"vllm_xargs": "kv_transfer_params"}, False),  # (vLLM refuses a non-object itself)
    ],
)
def test_has_client_params(body: dict[str, Any], expected: bool) -> None:
    assert has_client_params(body) is expected


def test_body_key() -> None:
    assert kv_params.BODY_KEY == "kv_transfer_params"


# --- one owner of the wire format --------------------------------------------------------------


def test_remote_block_ids_is_spelled_only_in_kv_params() -> None:
    packages = ("prefill", "decode", "proxy", "launch", "transport")
    holders = {
        path.relative_to(REPO_ROOT).as_posix()
        for package in packages
        for path in (REPO_ROOT / package).rglob("*.py")
        if "remote_block_ids" in path.read_text(encoding="utf-8", errors="replace")
    }
    assert holders == {"transport/kv_params.py"}


@pytest.mark.parametrize(("param", "expected"), [
    ("kv_transfer_params.prompt_token_ids", True),  # vLLM's words for refused ids
    ("kv_transfer_params", True),
    ("kv_transfer_params['prompt_token_ids']", True),
    ("max_tokens", False),  # the client's own field
    ("messages", False),
    ("kv_transfer_paramsX", False),
    (None, False),  # vLLM names no field: the proxy cannot tell whose it is
])
def test_names_handoff(param: str | None, expected: bool) -> None:
    """Only an error naming what the proxy alone sends (clients' params are refused) is the
    hand-off's: the decode leg then computes the prompt instead of failing the client."""
    assert kv_params.names_handoff(param) is expected
