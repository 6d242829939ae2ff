"""vLLM KV-event payloads decode into typed events (payloads built like vLLM's publisher)."""

from __future__ import annotations

import json

import msgspec
import pytest

from transport.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EventFormatError,
    decode_batch,
    kv_events_config,
)


def vllm_payload(events: list) -> bytes:
    """Encode exactly as vLLM 0.32's ZmqEventPublisher does, with vLLM's own classes."""
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=events))


def test_decodes_vllm_encoded_batch():
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    payload = vllm_payload([
        BlockStored(block_hashes=[b"h1", b"h2"], parent_block_hash=None,
                    token_ids=list(range(32)), block_size=16, lora_id=None, medium="GPU",
                    lora_name=None),
        BlockRemoved(block_hashes=[b"h1"], medium="CPU"),
        AllBlocksCleared(),
    ])
    events = decode_batch(payload)
    assert events[0] == BlocksStored((b"h1", b"h2"), None, tuple(range(32)), 16, "GPU")
    assert events[1] == BlocksRemoved((b"h1",), "CPU")
    assert events[2] == AllCleared("GPU")  # vLLM's device block pool: its tier only


def test_null_medium_is_the_device_tier_and_unknown_events_are_skipped():
    payload = msgspec.msgpack.encode([1.0, [
        {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": 3,
         "token_ids": [1, 2], "block_size": 2, "medium": None},
        {"type": "SomethingNew", "x": 1},
    ]])
    (ev,) = decode_batch(payload)
    assert ev.tier == "GPU" and ev.parent_hash == 3


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode({"a": 1}),
                                     msgspec.msgpack.encode([1.0, [5]])])
def test_malformed_payloads_raise(payload):
    with pytest.raises(EventFormatError):
        decode_batch(payload)


def _stored_map(**over) -> dict:
    return {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": None,
            "lora_name": None, **over}


MALFORMED_EVENTS = {
    "stored without fields": {"type": "BlockStored", "block_hashes": [1]},
    "null token ids": _stored_map(token_ids=None),
    "token ids not ints": _stored_map(token_ids=["a", 2, 3, 4]),
    "token ids bools": _stored_map(token_ids=[True, 2, 3, 4]),
    "block size a string": _stored_map(block_size="x"),
    "block size zero with tokens": _stored_map(block_size=0),
    "block size negative": _stored_map(block_size=-4, token_ids=[]),
    "hashes not a list": _stored_map(block_hashes=7),
    "a map as a hash": _stored_map(block_hashes=[{"h": 1}]),
    "a map as the parent": _stored_map(parent_block_hash={"h": 1}),
    "medium a list": _stored_map(medium=["GPU"]),
    "extra keys a number": _stored_map(extra_keys=5),
    "removed without hashes": {"type": "BlockRemoved"},
    "removed hashes null": {"type": "BlockRemoved", "block_hashes": None},
    "cleared on a map medium": {"type": "AllBlocksCleared", "medium": {"x": 1}},
}


@pytest.mark.parametrize("bad", MALFORMED_EVENTS.values(), ids=MALFORMED_EVENTS.keys())
def test_a_malformed_event_refuses_its_batch(bad: dict) -> None:
    """EventFormatError, never KeyError/TypeError (the feed resets its index on it and goes on),
    and for the whole batch: the good event beside it is not applied alone."""
    with pytest.raises(EventFormatError, match="malformed KV event 1"):
        decode_batch(msgspec.msgpack.encode([1.0, [_stored_map(), bad]]))


def test_an_offload_tiers_store_without_tokens_is_read():
    """vLLM's OffloadingConnector publishes a block it has no metadata for with no token ids
    and block size 0 (``offloading/events.py``, ``_placeholder_stored``): matched by hash."""
    from vllm.distributed.kv_events import BlockStored

    (stored,) = decode_batch(vllm_payload([BlockStored(
        block_hashes=[b"h1"], parent_block_hash=None, token_ids=[], block_size=0,
        lora_id=None, medium="CPU", lora_name=None)]))
    assert stored == BlocksStored((b"h1",), None, (), 0, "CPU")


def test_engine_config():
    cfg = json.loads(kv_events_config("tcp://*:5700"))
    assert cfg == {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": "tcp://*:5700", "topic": "kv"}
    assert json.loads(kv_events_config("ipc:///tmp/x"))["endpoint"] == "ipc:///tmp/x"
    with pytest.raises(ValueError, match="binds"):  # vLLM would connect, not bind
        kv_events_config("tcp://127.0.0.1:5700")


# --- what the index makes of them (vLLM 0.32's events, through ``decode_batch``) ------------

def _stored(hashes, parent, tokens, *, salt=None, lora=None, block_size=4):
    """A ``BlockStored`` as vLLM publishes it: a salt is in block 0's extra keys (and so in
    every later block's hash), a LoRA name in each block's."""
    from vllm.distributed.kv_events import BlockStored

    extra = None
    if salt or lora:
        extra = [tuple(k for k in ((lora,) if lora else ()) + ((salt,) if salt and i == 0
                                                                  else ())) or None
                 for i in range(len(hashes))]
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(tokens),
                       block_size=block_size, lora_id=1 if lora else None, medium="GPU",
                       lora_name=lora, extra_keys=extra)


def _index(*events):
    from proxy.prefix_index import PrefixIndex

    index = PrefixIndex()
    index.apply(decode_batch(vllm_payload(list(events))))
    return index


def test_salted_or_lora_blocks_are_no_hit_for_a_plain_prompt():
    """vLLM folds a ``cache_salt`` (block 0) and a LoRA name (each block) into the block hash:
    a request without them recomputes those tokens."""
    assert _index(_stored([11, 12], None, range(8), salt="tenant-a")).cached_tokens(
        list(range(8))) == 0
    assert _index(_stored([21, 22], None, range(8), lora="sql")).cached_tokens(
        list(range(8))) == 0
    assert _index(_stored([31, 32], None, range(8))).cached_tokens(list(range(8))) == 8


def test_a_salted_prompt_is_looked_up_with_its_salt():
    """Block 0's extra keys as vLLM's own ``to_event_extra_keys`` publishes a cache salt: the
    same tokens with the same salt are a hit, with another salt or none a miss."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys

    extra = to_event_extra_keys([(("cache_salt", "tenant-a"),), None])
    index = _index(BlockStored(block_hashes=[41, 42], parent_block_hash=None,
                               token_ids=list(range(8)), block_size=4, lora_id=None,
                               medium="GPU", lora_name=None, extra_keys=extra))
    assert index.cached_tokens(list(range(8)), salt="tenant-a") == 8
    assert index.cached_tokens(list(range(8)), salt="tenant-b") == 0
    assert index.cached_tokens(list(range(8))) == 0


def test_a_block_announced_again_is_still_one_block():
    """``kv_cache_report_mode: full`` (a client's ``vllm_xargs``) re-announces reused blocks on
    every hit; their eviction is announced once."""
    from vllm.distributed.kv_events import BlockRemoved

    index = _index(_stored([1, 2], None, range(8)), _stored([1, 2], None, range(8)))
    index.apply(decode_batch(vllm_payload([BlockRemoved(block_hashes=[1, 2], medium="GPU")])))
    assert index.cached_tokens(list(range(8))) == 0 and len(index) == 0


def test_blocks_of_the_same_tokens_under_two_hashes_are_forgotten_each():
    from vllm.distributed.kv_events import BlockRemoved

    index = _index(_stored([1], None, range(4)), _stored([2], None, range(4), salt="s"))
    index.apply(decode_batch(vllm_payload([BlockRemoved(block_hashes=[1], medium="GPU"),
                                           BlockRemoved(block_hashes=[2], medium="GPU")])))
    assert len(index) == 0 and not index._key_of
