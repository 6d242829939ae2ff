"""The prefix index answers 'how many leading tokens does this engine hold' from its events."""

from __future__ import annotations

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
