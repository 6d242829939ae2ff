"""The one owner of vLLM's ``kv_transfer_params`` wire format (NixlConnector, pull mode).

Every key of ``kv_transfer_params`` is spelled in this module and nowhere else. The proxy asks it
for the params of a prefill request, turns the prefill's reply into a typed, frozen
:class:`PrefillHandoff`, and asks it for the decode request's params.

Wire versions (bump on any change to what we send or require):
  1: vLLM 0.32 / NIXL connector version 14 — pull mode; decode gets the prefill's params verbatim
     plus ``prompt_token_ids`` so it skips templating and tokenization.
  2: plus ``pdserve_read_by`` (unix seconds) on the decode request: pdserve's NIXL connector
     (``transport/nixl_lease.py``) does not read a hand-off that reaches its scheduler later.

The prompt's token ids cross the proxy as the JSON text the prefill engine wrote: checked by
byte scans (a list of non-negative integers), counted, and spliced verbatim into the decode
request (``msgspec.Raw``), never turned into Python ints. A 128k-token prompt's ids are ~0.8 MB
of JSON; decoding and re-encoding them held the proxy's event loop for milliseconds per hand-off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

WIRE_VERSION = 2

#: The request-body field that carries the params, on requests and on replies.
BODY_KEY = "kv_transfer_params"
#: The top-level reply field with the prompt's token ids (present when ``return_token_ids``).
PROMPT_TOKEN_IDS_KEY = "prompt_token_ids"
#: Decode-request key: read the hand-off's blocks only before this time (unix seconds).
READ_BY_KEY = "pdserve_read_by"

_REQUIRED_HANDOFF_KEYS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
)


class HandoffError(ValueError):
    """The prefill's reply cannot be handed to a decode engine (missing or malformed params)."""


def prefill_request_params() -> dict[str, Any]:
    """Params that make an engine prefill a prompt and hold its KV for a remote decode."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


@dataclass(frozen=True)
class PrefillHandoff:
    """What a finished prefill hands to a decode engine: where its KV blocks are, and the prompt
    ids.

    ``params`` is the prefill's ``kv_transfer_params`` exactly as received (engines may add keys we
    don't interpret; they must still reach decode).
    """

    engine_id: str
    request_id: str
    host: str
    port: int
    num_blocks: int
    num_tokens: int
    cached_tokens: int
    #: The prompt's token ids as the JSON array the prefill engine wrote (checked), and their count.
    prompt_token_ids_json: bytes = field(repr=False)
    num_prompt_tokens: int
    params: Mapping[str, Any] = field(repr=False)

    @property
    def has_blocks(self) -> bool:
        return self.num_blocks > 0

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The ids as ints (decoded on each call: diagnostics and tests, not the hot path)."""
        return tuple(msgspec.json.decode(self.prompt_token_ids_json, type=list[int]))


class _ReplyChoice(msgspec.Struct):
    prompt_token_ids: msgspec.Raw = msgspec.Raw(b"null")


class _Reply(msgspec.Struct):
    """The parts of a prefill reply the hand-off needs; the ids stay raw JSON."""

    kv_transfer_params: Any = None
    prompt_token_ids: msgspec.Raw = msgspec.Raw(b"null")
    choices: Any = None


_REPLY = msgspec.json.Decoder(_Reply)
_CHOICE = msgspec.json.Decoder(_ReplyChoice)
_ID_BYTES = b"0123456789, \t\r\n"
#: Every digit as "0", every other byte as ",": an id's digits become a run of zeros.
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x2C for b in range(256))
#: The shortest id that may not fit an int64 (2**63 has 19 digits; JSON has no leading zeros).
_LONG_ID = b"0" * 19
_ID_LIMIT = 2**63


def count_token_ids(raw: bytes) -> int:
    """The number of ids in ``raw``, a JSON array of integers in [0, 2**63); HandoffError when
    it is anything else. ``raw`` must be well-formed JSON (a value msgspec decoded, or encoded):
    then an array holding only digits, commas and whitespace is a list of ids, and one with no
    run of 19 digits has none over int64. Byte scans in C, no Python int per id (this runs on
    every hand-off: ~0.6 ms for 128k ids here, about twice that with the int64 check)."""
    if raw.translate(None, _ID_BYTES) != b"[]" or not raw.strip(b"[] \t\r\n"):
        raise HandoffError(f"prefill reply has no usable {PROMPT_TOKEN_IDS_KEY}")
    if _LONG_ID in raw.translate(_DIGITS_AS_ZEROS) and max(msgspec.json.decode(raw)) >= _ID_LIMIT:
        raise HandoffError(f"prefill {PROMPT_TOKEN_IDS_KEY} hold an id over int64")
    return raw.count(b",") + 1


def parse_prefill_json(body: bytes) -> PrefillHandoff:
    """:func:`parse_prefill_reply` straight from the reply's bytes, the ids kept raw."""
    try:
        reply = _REPLY.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HandoffError(f"prefill reply is not a JSON object: {exc}") from None
    ids = reply.prompt_token_ids
    if bytes(ids) == b"null":  # completions put the ids on the choice
        choices = reply.choices
        first = choices[0] if isinstance(choices, list) and choices else None
        if isinstance(first, Mapping) and PROMPT_TOKEN_IDS_KEY in first:
            ids = msgspec.Raw(msgspec.json.encode(first[PROMPT_TOKEN_IDS_KEY]))
    return _handoff(reply.kv_transfer_params, bytes(ids))


def parse_prefill_reply(reply: Mapping[str, Any]) -> PrefillHandoff:
    """Turn a prefill engine's JSON reply (chat or completions) into a :class:`PrefillHandoff`.

    Raises :class:`HandoffError` when the reply lacks what decode needs to pull the KV: without
    it, decode would silently recompute (or, worse, read someone else's blocks).
    """
    if not isinstance(reply, Mapping):
        raise HandoffError("prefill reply is not a JSON object")
    ids = reply.get(PROMPT_TOKEN_IDS_KEY)
    if ids is None:
        # Completions put the ids on the choice.
        choices = reply.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        ids = first.get(PROMPT_TOKEN_IDS_KEY) if isinstance(first, Mapping) else None
    if not isinstance(ids, list) or set(map(type, ids)) - {int}:
        raise HandoffError(f"prefill reply has no usable {PROMPT_TOKEN_IDS_KEY}")
    return _handoff(reply.get(BODY_KEY), msgspec.json.encode(ids))


def _handoff(params: Any, ids_json: bytes) -> PrefillHandoff:
    """Check what the decode engine acts on (whom its NIXL side channel calls, which blocks it
    reads, the prompt it takes) before it is forwarded: each field in the type and range vLLM's
    NixlConnector writes (``request_finished`` on the prefill's scheduler), nothing looser."""
    if not isinstance(params, Mapping):
        raise HandoffError(f"prefill reply has no {BODY_KEY}")
    missing = [k for k in _REQUIRED_HANDOFF_KEYS if params.get(k) is None]
    if missing:
        raise HandoffError(f"prefill {BODY_KEY} lack {', '.join(missing)}")
    if params.get("do_remote_prefill") is not True:
        raise HandoffError("prefill do_remote_prefill is not true: nothing to pull")
    engine_id, request_id, host = (params[k] for k in (
        "remote_engine_id", "remote_request_id", "remote_host"))
    if not all(isinstance(v, str) and v for v in (engine_id, request_id, host)):
        raise HandoffError("prefill remote_engine_id, remote_request_id or remote_host is not a "
                           "string")
    port = _count(params, "remote_port")
    if not 0 < port < 65536:
        raise HandoffError(f"prefill remote_port {port} is not a TCP port")
    num_blocks = _num_blocks(params["remote_block_ids"])
    num_ids = count_token_ids(ids_json)
    num_tokens = _count(params, "remote_num_tokens")
    cached_tokens = _count(params, "remote_prefill_cached_tokens")
    if cached_tokens > num_ids:
        raise HandoffError(f"prefill cached {cached_tokens} tokens of a {num_ids}-token prompt")
    return PrefillHandoff(
        engine_id=engine_id,
        request_id=request_id,
        host=host,
        port=port,
        num_blocks=num_blocks,
        num_tokens=num_tokens,
        cached_tokens=cached_tokens,
        prompt_token_ids_json=ids_json,
        num_prompt_tokens=num_ids,
        params=dict(params),
    )


def _count(params: Mapping[str, Any], key: str) -> int:
    """``params[key]``, an int >= 0 (vLLM writes ints; bool is an int subclass, and refused); a
    missing or null count is 0."""
    value = params.get(key)
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        raise HandoffError(f"prefill {key} is not an integer >= 0")
    return value


#: Per KV cache group, the prefill's block ids (vLLM's ``BlockIds``; 0 is its null block).
#: Checked in C: thousands of ids on a long prompt's hand-off.
_BLOCK_GROUPS = list[list[Annotated[int, msgspec.Meta(ge=0)]]]


def _num_blocks(block_groups: Any) -> int:
    try:
        msgspec.convert(block_groups, _BLOCK_GROUPS, strict=True)
    except msgspec.ValidationError as exc:
        raise HandoffError(f"prefill remote_block_ids is not a list of block id lists: {exc}"
                           ) from None
    return sum(len(g) for g in block_groups)


def decode_request_params(handoff: PrefillHandoff, read_by: float | None = None, *,
                          raw_ids: bool = False) -> dict[str, Any]:
    """Params for the decode request: pull ``handoff``'s blocks and reuse its prompt token ids;
    with ``read_by`` (unix seconds), only if the decode engine gets to them before then.

    ``raw_ids``: the ids as the prefill's JSON (a ``msgspec.Raw``, spliced verbatim when the body
    is encoded with msgspec: the proxy's hot path); otherwise a list, for any JSON encoder."""
    params = dict(handoff.params)
    params[PROMPT_TOKEN_IDS_KEY] = (msgspec.Raw(handoff.prompt_token_ids_json) if raw_ids
                                    else list(handoff.prompt_token_ids))
    if read_by is not None:
        params[READ_BY_KEY] = read_by
    return params


def names_handoff(param: str | None) -> bool:
    """True when an engine's error names (in its ``param``) the transfer params, or a key in
    them: what the proxy sent, never the client (:func:`client_params` refuses theirs). vLLM
    names ``kv_transfer_params.prompt_token_ids`` when it refuses the forwarded ids."""
    return param is not None and (param == BODY_KEY or param.startswith((f"{BODY_KEY}.",
                                                                           f"{BODY_KEY}[")))


def drop_late_handoff(params: dict[str, Any] | None, now: float) -> bool:
    """On the decode engine: drop a hand-off whose read-by time is before ``now`` (unix
    seconds), so the engine computes the prompt instead; True when dropped. The read-by key is
    removed either way: only the first look at a request counts."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return False
    read_by = params.pop(READ_BY_KEY, None)
    if isinstance(read_by, bool) or not isinstance(read_by, (int, float)) or now <= read_by:
        return False
    params["do_remote_prefill"] = False
    params.pop("remote_block_ids", None)  # nothing to read, nothing to release on prefill
    return True


#: pdserve's request field for per-request KV limits (clients may set these, never the params).
LIMITS_KEY = "kv_limits"
_TIERS = ("cpu", "storage")


@dataclass(frozen=True)
class KVLimits:
    """Per-request limits vLLM 0.32's OffloadingConnector honours (experimental there):

    ``max_load_tokens``: at most this many tokens loaded from offload tiers (the rest computed);
    ``max_offload_tokens``: at most this many of the request's tokens stored to the tiers;
    ``load_tiers``: which tiers may be read (``[]``: none). They do not limit a NIXL hand-off
    (whether KV moves from prefill is the proxy's route decision).
    """

    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    load_tiers: tuple[str, ...] | None = None

    def params(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.max_load_tokens is not None:
            out["max_load_tokens"] = self.max_load_tokens
        if self.max_offload_tokens is not None:
            out["max_offload_tokens"] = self.max_offload_tokens
        if self.load_tiers is not None:
            out["kv_load_tiers"] = [{"medium": t.upper()} for t in self.load_tiers]
        return out


def parse_limits(raw: Any) -> KVLimits:
    """A client's ``kv_limits`` object; ValueError naming what is wrong."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{LIMITS_KEY} must be an object")
    unknown = set(raw) - {"max_load_tokens", "max_offload_tokens", "load_tiers"}
    if unknown:
        raise ValueError(f"{LIMITS_KEY} has unsupported keys: {', '.join(sorted(unknown))}")
    for key in ("max_load_tokens", "max_offload_tokens"):
        v = raw.get(key)
        if v is not None and (type(v) is not int or v < 0):
            raise ValueError(f"{LIMITS_KEY}.{key} must be an integer >= 0")
    tiers = raw.get("load_tiers")
    if tiers is not None:
        if not isinstance(tiers, list) or any(t not in _TIERS for t in tiers):
            raise ValueError(f"{LIMITS_KEY}.load_tiers must be a list of {', '.join(_TIERS)}")
        tiers = tuple(dict.fromkeys(tiers))
    return KVLimits(raw.get("max_load_tokens"), raw.get("max_offload_tokens"), tiers)


def with_limits(params: Mapping[str, Any] | None, limits: KVLimits | None
                ) -> dict[str, Any] | None:
    """``params`` (or none) with ``limits`` added: what an engine request carries."""
    extra = limits.params() if limits is not None else {}
    if params is None and not extra:
        return None
    return {**(params or {}), **extra}


#: The engine's transfer params (KV, and encoder cache): set by the server alone.
_SERVER_KEYS = (BODY_KEY, "ec_transfer_params")


def client_params(body: Mapping[str, Any]) -> str | None:
    """The field through which a client tried to send its own transfer params, or None. Never
    allowed to reach an engine: they say where it reads KV from (SSRF), and a malformed value
    kills vLLM's engine core. vLLM also takes them from ``vllm_xargs`` (its ``extra_args``,
    where the engine reads them: ``vllm.v1.request``)."""
    for key in _SERVER_KEYS:
        if key in body:
            return key
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, Mapping) and any(key in xargs for key in _SERVER_KEYS):
        return "vllm_xargs"
    return None


def has_client_params(body: Mapping[str, Any]) -> bool:
    """True when a client tried to send its own params (:func:`client_params`)."""
    return client_params(body) is not None
