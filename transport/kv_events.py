"""The one owner of vLLM's KV cache event wire format (``--kv-events-config``, ZMQ PUB).

vLLM publishes multipart messages ``(topic, seq: 8 bytes big-endian, payload)``; the payload is a
msgpack ``EventBatch`` array ``[ts, events, dp_rank?]`` whose events are maps tagged by ``type``:
``BlockStored`` (block hashes, parent hash, the blocks' token ids, block size, medium),
``BlockRemoved`` (block hashes, medium) and ``AllBlocksCleared``. This module turns a payload
into frozen typed events and builds the engine-side config; it does no I/O.

Wire versions: 1 — vLLM 0.32 (tagged map events, ``medium`` GPU/CPU/STORAGE, may be null).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Hashable

import msgspec

WIRE_VERSION = 1
#: vLLM's tier names; a null medium means the engine's own (device) cache.
DEVICE_TIER = "GPU"


@dataclass(frozen=True)
class BlocksStored:
    block_hashes: tuple[Hashable, ...]
    parent_hash: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: str
    #: Per block, what vLLM folds into its hash besides the tokens (LoRA name, mm ids,
    #: cache_salt on block 0), untagged as published; None when there are none.
    extra_keys: tuple[Hashable, ...] | None = None


@dataclass(frozen=True)
class BlocksRemoved:
    block_hashes: tuple[Hashable, ...]
    tier: str


@dataclass(frozen=True)
class AllCleared:
    #: The tier cleared; None: every tier (the engine restarted, or events were lost). vLLM's
    #: own event comes from its device block pool (``/reset_prefix_cache``): an offload tier
    #: keeps its blocks unless the reset also asked for it (``reset_external``), which
    #: publishes nothing.
    tier: str | None = None


KVEvent = BlocksStored | BlocksRemoved | AllCleared


class EventFormatError(ValueError):
    pass


def _hashable(h: Any) -> Hashable:
    return tuple(h) if isinstance(h, list) else h


def _extra(ev: dict) -> tuple[Hashable, ...] | None:
    keys = ev.get("extra_keys")
    lora = ev.get("lora_name")
    if not keys and not lora:
        return None
    n = len(ev["block_hashes"])
    keys = list(keys or []) + [None] * (n - len(keys or []))
    out = tuple(_deep(k) if k else ((lora,) if lora else None) for k in keys[:n])
    return out if any(out) else None


def _deep(x: Any) -> Hashable:
    return tuple(_deep(v) for v in x) if isinstance(x, (list, tuple)) else x


def decode_batch(payload: bytes) -> list[KVEvent]:
    """Decode one ``EventBatch`` payload; unknown event types are skipped (forward-compatible).

    A malformed event refuses the whole batch (EventFormatError naming it): the caller then
    holds a batch it could not read, as good as lost, and resets what it mirrors rather than
    apply the rest (a missed removal would over-report cached blocks for good)."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventFormatError(f"undecodable KV event batch: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise EventFormatError("KV event batch is not [ts, events, ...]")
    out: list[KVEvent] = []
    for i, ev in enumerate(batch[1]):
        if not isinstance(ev, dict):
            raise EventFormatError("KV event is not a map")
        try:
            event = _event(ev)
        except (KeyError, TypeError, ValueError, msgspec.ValidationError) as exc:
            raise EventFormatError(f"malformed KV event {i} ({ev.get('type')!r}): "
                                   f"{type(exc).__name__}: {exc}") from None
        if event is not None:
            out.append(event)
    return out


_TOKEN_IDS = list[int]


def _event(ev: dict) -> KVEvent | None:
    """One event map as a typed event, None for an unknown type; KeyError, TypeError or
    ValueError when it is not what vLLM publishes."""
    kind = ev.get("type")
    medium = ev.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise TypeError(f"medium is {type(medium).__name__}")
    tier = medium or DEVICE_TIER
    if kind == "BlockStored":
        block_size = ev["block_size"]
        token_ids = tuple(msgspec.convert(ev["token_ids"], _TOKEN_IDS, strict=True))
        # (An offload tier's store of a block it has no metadata for: no tokens, size 0.)
        if type(block_size) is not int or block_size < 0 or (token_ids and not block_size):
            raise ValueError(f"block_size {block_size!r} is not a positive integer")
        stored = BlocksStored(
            block_hashes=_hashes(ev["block_hashes"]),
            parent_hash=_hashable(ev.get("parent_block_hash")),
            token_ids=token_ids,
            block_size=block_size,
            tier=tier,
            extra_keys=_extra(ev),
        )
        hash((stored.parent_hash, stored.extra_keys))  # the index keys blocks by these
        return stored
    if kind == "BlockRemoved":
        return BlocksRemoved(_hashes(ev["block_hashes"]), tier)
    if kind == "AllBlocksCleared":
        return AllCleared(tier)
    return None


def _hashes(raw: Any) -> tuple[Hashable, ...]:
    if not isinstance(raw, list):
        raise TypeError(f"block_hashes is {type(raw).__name__}, not a list")
    hashes = tuple(_hashable(h) for h in raw)
    hash(hashes)  # TypeError for a map among them
    return hashes


def kv_events_config(endpoint: str, topic: str = "kv") -> str:
    """``--kv-events-config`` for an engine publishing on ``endpoint``: ``tcp://*:port`` or
    ``ipc://path`` (vLLM binds those; any other TCP address it would connect to)."""
    if not endpoint.startswith(("ipc://", "tcp://*:")):
        raise ValueError(f"a KV-event publisher binds ipc:// or tcp://*:port, not {endpoint!r}")
    return json.dumps({
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": topic,
    }, separators=(",", ":"))
