"""Which prompt prefixes each engine holds, per tier, rebuilt from the engines' KV events.

Blocks are keyed by their content chain (the key of the parent block plus this block's token
ids), so a lookup needs only the prompt's token ids and the block size, not vLLM's hash function
or seed. Offload tiers (vLLM's OffloadingConnector, medium ``CPU``) publish stores without token
ids, naming blocks by the engine's block hash: those are matched through the engine's earlier
event for the same hash (kept a while after the engine itself dropped the block).

A block vLLM hashed with more than its tokens (a ``cache_salt``, a LoRA adapter, media: the
event's extra keys) is keyed with them, so it is never a hit for a prompt without them. A
prompt is looked up with its ``cache_salt`` (vLLM puts it in block 0's keys); LoRA adapters
and media are not looked up (their hits go unseen, which only under-reports). A block
announced again (vLLM's ``kv_cache_report_mode: full`` re-announces reused blocks on every
hit) is still one block: its one removal forgets it. A device cache reset (vLLM's
``/reset_prefix_cache``) forgets the device tier only: vLLM does not publish the offload
tier's reset (``reset_external=true``), so after one the index over-reports that tier.

A prompt is looked up by its block keys (:func:`block_keys`, computed where it was tokenized:
a worker process, off the proxy's event loop); ``cached_keys(keys)`` walks them and returns how
many leading tokens the engine can load instead of computing (any tier, or one).
``cached_tokens(ids)`` does both for a prompt given as token ids.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from transport.kv_events import AllCleared, BlocksRemoved, BlocksStored, KVEvent

ContentKey = int
#: The parent of a prompt's first block. An int, not None: ``hash`` of ints and tuples of ints
#: is the same in every process, so a tokenizer worker computes the keys this index holds
#: (``hash(None)`` is an address in Python 3.11).
_ROOT: ContentKey = 0


def _chain(parent: ContentKey, tokens: Sequence[int], extra: Hashable = None) -> ContentKey:
    if not extra:
        return hash((parent, tuple(tokens)))
    return hash((parent, tuple(tokens), _stable(extra)))


def _stable(extra: Hashable) -> int:
    """A block's extra keys (strings, bytes, ints, in tuples) as an int that is the same in
    every process: ``hash`` of a string is not (a worker computes the keys the index holds)."""
    digest = hashlib.blake2b(repr(extra).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def block_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> array:
    """The content key of each full block of a prompt (signed 64-bit; the last partial block
    has none): what :meth:`PrefixIndex.cached_keys` looks up. ``salt``: the request's
    ``cache_salt``, which vLLM hashes into block 0 (published as that block's extra key)."""
    keys = array("q")
    parent = _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = token_ids[start:start + block_size]
        parent = _chain(parent, tokens, (salt,) if salt and start == 0 else None)
        keys.append(parent)
    return keys


class PrefixIndex:
    """One engine's cached blocks. Not thread-safe; fed and read on the event loop."""

    #: How many dropped blocks' hash -> content mappings are kept for late tier events.
    RECENT = 65536

    def __init__(self) -> None:
        self.block_size: int | None = None
        self._key_of: dict[Hashable, ContentKey] = {}  # engine's block hash -> content key
        self._tiers: dict[ContentKey, Counter[str]] = {}  # content key -> tiers holding it
        self._recent: OrderedDict[Hashable, ContentKey] = OrderedDict()  # dropped, recently
        self._held: dict[Hashable, set[str]] = {}  # engine's block hash -> tiers holding it

    def __len__(self) -> int:
        return len(self._tiers)

    def apply(self, events: Iterable[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlocksStored):
                self._store(ev)
            elif isinstance(ev, BlocksRemoved):
                for h in ev.block_hashes:
                    key = self._key_of.get(h)
                    held = self._held.get(h)
                    if key is None or held is None or ev.tier not in held:
                        continue
                    held.discard(ev.tier)
                    tiers = self._tiers[key]
                    tiers[ev.tier] -= 1
                    if tiers[ev.tier] <= 0:
                        del tiers[ev.tier]
                    if not tiers:
                        del self._tiers[key]
                    if not held:
                        del self._held[h]
                        self._forget(h)
            elif isinstance(ev, AllCleared) and ev.tier is not None:
                self.apply([BlocksRemoved(tuple(h for h, held in self._held.items()
                                                if ev.tier in held), ev.tier)])
            elif isinstance(ev, AllCleared):
                self._key_of.clear()
                self._tiers.clear()
                self._recent.clear()
                self._held.clear()

    def _forget(self, h: Hashable) -> None:
        self._recent[h] = self._key_of.pop(h)
        if len(self._recent) > self.RECENT:
            self._recent.popitem(last=False)

    def _store(self, ev: BlocksStored) -> None:
        if not ev.token_ids:  # a tier storing blocks the engine computed: match by hash
            for h in ev.block_hashes:
                key = self._key_of.get(h)
                if key is None and (key := self._recent.pop(h, None)) is not None:
                    self._key_of[h] = key
                if key is not None:
                    self._add(h, key, ev.tier)
            return
        self.block_size = ev.block_size
        parent = self._key_of.get(ev.parent_hash) if ev.parent_hash is not None else _ROOT
        if parent is None:
            return  # parent unknown (we joined late): these blocks cannot be matched by prefix
        bs = ev.block_size
        for i, h in enumerate(ev.block_hashes):
            tokens = ev.token_ids[i * bs:(i + 1) * bs]
            if len(tokens) < bs:
                break
            extra = ev.extra_keys[i] if ev.extra_keys and i < len(ev.extra_keys) else None
            key = _chain(parent, tokens, extra)
            self._key_of[h] = key
            self._add(h, key, ev.tier)
            parent = key

    def _add(self, h: Hashable, key: ContentKey, tier: str) -> None:
        """Idempotent per (engine hash, tier): a re-announced block is still one block."""
        held = self._held.setdefault(h, set())
        if tier not in held:
            held.add(tier)
            self._tiers.setdefault(key, Counter())[tier] += 1

    def tiers(self) -> set[str]:
        return {t for tiers in self._tiers.values() for t in tiers}

    def cached_tokens(self, token_ids: Sequence[int], tier: str | None = None,
                      salt: str | None = None) -> int:
        """Leading tokens of ``token_ids`` (salted with ``salt``) held (in ``tier``, or any
        tier), in whole blocks."""
        if not self.block_size:
            return 0
        return self.cached_keys(block_keys(token_ids, self.block_size, salt), tier)

    def cached_keys(self, keys: Iterable[ContentKey], tier: str | None = None) -> int:
        """Leading tokens held (in ``tier``, or any tier) of a prompt whose blocks of this
        index's ``block_size`` have ``keys``: one dict lookup per block, up to the first miss."""
        n = 0
        for key in keys:
            tiers = self._tiers.get(key)
            if not tiers or (tier is not None and tier not in tiers):
                break
            n += 1
        return n * (self.block_size or 0)
