"""The prefix index answers 'how many leading tokens does this engine hold' from its events."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from proxy.kv_event_feed import run_feed
from proxy.prefix_index import PrefixIndex
from transport.kv_events import AllCleared, BlocksRemoved, BlocksStored

BS = 4


def stored(hashes, parent, tokens, tier="GPU"):
    return BlocksStored(tuple(hashes), parent, tuple(tokens), BS, tier)


def test_longest_cached_prefix_in_whole_blocks():
    idx = PrefixIndex()
    idx.apply([stored(["a", "b"], None, range(8)), stored(["c"], "b", range(8, 12))])
    assert idx.cached_tokens(list(range(12))) == 12
    assert idx.cached_tokens(list(range(14))) == 12  # partial last block never counts
    assert idx.cached_tokens(list(range(6))) == 4
    assert idx.cached_tokens([9, 9, 9, 9] + list(range(4, 12))) == 0  # differs in block 0
    assert idx.cached_tokens(list(range(4)) + [0, 0, 0, 0]) == 4


def test_removal_and_tiers():
    idx = PrefixIndex()
    idx.apply([stored(["a", "b"], None, range(8)), stored(["x", "y"], None, range(8), "CPU")])
    assert idx.cached_tokens(list(range(8)), tier="CPU") == 8
    idx.apply([BlocksRemoved(("b",), "GPU")])
    assert idx.cached_tokens(list(range(8)), tier="GPU") == 4
    assert idx.cached_tokens(list(range(8))) == 8  # still in the CPU tier
    idx.apply([BlocksRemoved(("x", "y"), "CPU")])
    assert idx.cached_tokens(list(range(8))) == 4


def test_unknown_parent_is_ignored_and_clear_empties():
    idx = PrefixIndex()
    idx.apply([stored(["q"], "never-seen", range(4))])
    assert len(idx) == 0
    idx.apply([stored(["a"], None, range(4))])
    assert len(idx) == 1
    idx.apply([AllCleared()])
    assert len(idx) == 0 and idx.cached_tokens(list(range(4))) == 0


def test_a_device_cache_reset_leaves_the_offload_tier_and_a_restart_clears_both():
    """vLLM's ``/reset_prefix_cache`` clears the device blocks (one AllBlocksCleared, device
    tier); the CPU tier keeps what it stored, and later tier events still match by hash."""
    idx = PrefixIndex()
    idx.apply([stored(["a", "b"], None, range(8)), offloaded(["a"]),
               stored(["c"], None, [7] * 4)])
    idx.apply([AllCleared("GPU")])
    assert idx.cached_tokens(list(range(8)), tier="GPU") == 0
    assert idx.cached_tokens(list(range(8))) == 4  # block a, in the CPU tier
    assert idx.cached_tokens([7] * 4) == 0
    idx.apply([offloaded(["b"])])  # stored after the reset, from the engine's earlier event
    assert idx.cached_tokens(list(range(8)), tier="CPU") == 8
    idx.apply([AllCleared()])  # the engine restarted (or events were lost): every tier
    assert len(idx) == 0 and idx.cached_tokens(list(range(8))) == 0


def test_same_content_under_two_hashes_survives_one_removal():
    idx = PrefixIndex()
    idx.apply([stored(["a"], None, range(4)), stored(["a2"], None, range(4))])
    idx.apply([BlocksRemoved(("a",), "GPU")])
    assert idx.cached_tokens(list(range(4))) == 4


def offloaded(hashes, tier="CPU"):
    """What vLLM's OffloadingConnector publishes: the engine's block hashes, no tokens, size 0."""
    return BlocksStored(tuple(hashes), None, (), 0, tier)


def test_offload_tier_events_name_engine_blocks_by_hash():
    """The engine computes a prefix, the tier stores its blocks, the engine evicts them: the
    prefix is still cached, in the CPU tier only; a later eviction from the tier drops it."""
    idx = PrefixIndex()
    idx.apply([stored(["a", "b"], None, range(8)), offloaded(["a", "b"])])
    assert idx.block_size == BS  # the tier's size-0 events do not clobber it
    assert idx.cached_tokens(list(range(8)), tier="CPU") == 8
    idx.apply([BlocksRemoved(("a", "b"), "GPU")])
    assert idx.cached_tokens(list(range(8)), tier="GPU") == 0
    assert idx.cached_tokens(list(range(8)), tier="CPU") == 8
    assert idx.cached_tokens(list(range(8))) == 8
    idx.apply([BlocksRemoved(("b",), "CPU")])
    assert idx.cached_tokens(list(range(8))) == 4


def test_tier_store_after_the_engine_dropped_the_block_still_matches():
    idx = PrefixIndex()
    idx.apply([stored(["a"], None, range(4)), BlocksRemoved(("a",), "GPU")])
    assert idx.cached_tokens(list(range(4))) == 0
    idx.apply([offloaded(["a"]), offloaded(["never-computed-here"])])
    assert idx.cached_tokens(list(range(4)), tier="CPU") == 4
    assert len(idx) == 1


# --- the feed that keeps it current (proxy/kv_event_feed.py, over a real ZMQ socket) --------

def _batch(*events: dict) -> bytes:
    return msgspec.msgpack.encode([0.0, list(events)])


def _stored_event(h: int, tokens: list[int]) -> dict:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": None,
            "lora_name": None}


class _Publisher:
    """An engine's side of the feed: numbered batches on a PUB socket."""

    def __init__(self, pub: zmq.asyncio.Socket):
        self.pub, self.seq = pub, 0

    async def send(self, payload: bytes) -> None:
        self.seq += 1
        await self.pub.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])


async def _until(check, what: str) -> None:
    """Poll ``check`` (the feed gives no signal of its own) for at most 5 s."""
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting until {what}")


@contextlib.asynccontextmanager
async def _feed(index: PrefixIndex, tmp_path: Path):
    endpoint = f"ipc://{tmp_path / 'events'}"
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    task = asyncio.create_task(run_feed(endpoint, index, ctx))
    publisher = _Publisher(pub)
    try:
        # ZMQ drops what a SUB socket receives before it is connected: announce until seen.
        async def connected() -> None:
            while not index.cached_tokens([0] * BS):
                await publisher.send(_batch(_stored_event(1000, [0] * BS)))
                await asyncio.sleep(0.01)
        await asyncio.wait_for(connected(), 5)
        yield publisher, task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # (its socket closed: the context can end)
        pub.close(0)
        ctx.term()


BAD_BATCHES = {
    "stored without fields": {"type": "BlockStored", "block_hashes": [1]},
    "null token ids": {**_stored_event(1, [1, 2, 3, 4]), "token_ids": None},
    "removed without hashes": {"type": "BlockRemoved"},
    "block size a string": {**_stored_event(1, [1, 2, 3, 4]), "block_size": "x"},
    "a map as a hash": {"type": "BlockRemoved", "block_hashes": [{"h": 1}]},
}


@pytest.mark.parametrize("bad", BAD_BATCHES.values(), ids=BAD_BATCHES.keys())
async def test_feed_resets_on_a_malformed_batch_and_goes_on(tmp_path: Path, bad: dict) -> None:
    """One batch it cannot read is lost events (the index is reset), not the feed's end: a dead
    feed would leave the index claiming every block it ever saw, for the proxy's lifetime."""
    index = PrefixIndex()
    async with _feed(index, tmp_path) as (engine, task):
        await engine.send(_batch(_stored_event(1, [1, 2, 3, 4])))
        await _until(lambda: index.cached_tokens([1, 2, 3, 4]) == 4, "stored")
        await engine.send(_batch(_stored_event(2, [5, 6, 7, 8]), bad))  # all or nothing
        await _until(lambda: len(index) == 0, "reset")
        await engine.send(_batch(_stored_event(3, [9, 9, 9, 9])))
        await _until(lambda: index.cached_tokens([9, 9, 9, 9]) == 4, "stored after")
        assert not task.done()
        assert index.cached_tokens([5, 6, 7, 8]) == 0


class _FailingIndex(PrefixIndex):
    """An index that fails halfway through one batch (a bug in it, say)."""

    def apply(self, events) -> None:
        events = list(events)
        super().apply(events[:1])
        if any(isinstance(e, BlocksRemoved) and e.block_hashes == (666,) for e in events):
            raise RuntimeError("index bug")
        super().apply(events[1:])


async def test_feed_resets_when_applying_a_batch_fails(tmp_path: Path) -> None:
    index = _FailingIndex()
    async with _feed(index, tmp_path) as (engine, task):
        await engine.send(_batch(_stored_event(1, [1, 2, 3, 4]),
                                 {"type": "BlockRemoved", "block_hashes": [666],
                                  "medium": None}))
        await _until(lambda: len(index) == 0, "reset")  # not left half-applied
        await engine.send(_batch(_stored_event(3, [9, 9, 9, 9])))
        await _until(lambda: index.cached_tokens([9, 9, 9, 9]) == 4, "stored after")
        assert not task.done()
