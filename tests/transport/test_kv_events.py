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
    assert isinstance(events[2], AllCleared)


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


def test_engine_config():
    cfg = json.loads(kv_events_config("tcp://*:5700"))
    assert cfg == {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": "tcp://*:5700", "topic": "kv"}
    assert json.loads(kv_events_config("ipc:///tmp/x"))["endpoint"] == "ipc:///tmp/x"
    with pytest.raises(ValueError, match="binds"):  # vLLM would connect, not bind
        kv_events_config("tcp://127.0.0.1:5700")
