"""Which prefill -> decode pairs can hand KV over: a pair whose pulls fail is routed around.

A decode engine that cannot read a prefill engine's KV serves the request anyway: it computes
the prompt itself (vLLM's ``kv_load_failure_policy=recompute``). The client sees only a slow
first token, and the prefill engine's work was wasted. Causes are per pair, and they last:
engines built from different vLLM, model path or dtype ("NIXL compatibility hash mismatch"), or
a pair that cannot reach each other's side channel or KV. Sent there again and again, every
such request pays a prefill twice.

The decode engine counts its failed pulls, not whose KV they were. Each probe reads the count
(``Engine.update_load``), and :meth:`PairHealth.looked` lays the new failures on the pairs
whose hand-overs the engine took since its last look (:meth:`PairHealth.pulled`, recorded at
each hand-over's first byte or whole reply: by then its pull has succeeded or failed).
:func:`blame` is the rule. When a look cannot tell whose pulls failed (several pairs in its
window, and no way to split the failures), the decode engine is watched for a while: looked at
after each hand-over (``EnginePool.pulled``), so that a look holds one.

A blamed pair is left out of the picks for a backoff (10 s at first, doubling while it keeps
failing, up to 5 min). After the backoff, hand-overs go there again, and a look that finds them
without failures clears the pair. An engine that comes up (a restart, a new engine under the
same name) starts with a clean slate.

Pure state with no I/O and no clock of its own: the pool feeds it and asks it
(``proxy/pool.py``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

BACKOFF_S = 10.0
MAX_BACKOFF_S = 300.0
#: How long a decode engine is looked at after each hand-over, once a look could not tell.
WATCH_S = 30.0


def blame(handovers: Mapping[str, int], failed: int) -> frozenset[str]:
    """The prefill engines whose hand-overs failed, from one look at a decode engine:
    ``handovers`` counts its hand-overs per prefill engine since the look before, ``failed``
    the pulls it reported failed in that time.

    The count can be lower than the requests that failed: vLLM counts a failed NIXL handshake
    once, however many requests waited on it (and KV whose lease ran out apart, not here).
    - One pair in the window: any failure is its.
    - As many failures as hand-overs (or more: a count can lag a look): each pair failed.
    - Fewer, over several pairs: the one pair whose hand-overs are exactly the failures (its
      pulls all failed, the others' none). With no such pair, or two, the look cannot tell,
      and blames no one: a later look will, as the hand-overs of each window differ.
    """
    total = sum(handovers.values())
    if failed <= 0 or total == 0:
        return frozenset()
    if failed >= total or len(handovers) == 1:
        return frozenset(p for p, n in handovers.items() if n > 0)
    exact = [p for p, n in handovers.items() if n == failed]
    return frozenset(exact) if len(exact) == 1 else frozenset()


@dataclass
class _Pair:
    #: Left out until this time (monotonic seconds); 0: never.
    until: float = 0.0
    #: The next backoff; 0 while the pair has not failed since it was last clear.
    backoff_s: float = 0.0
    #: Looks that blamed the pair, in all.
    blamed: int = 0


class PairHealth:
    def __init__(self, backoff_s: float = BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S):
        self._backoff_s, self._max_backoff_s = backoff_s, max_backoff_s
        self._window: dict[str, Counter[str]] = {}  # decode -> prefill -> hand-overs
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._watch: dict[str, float] = {}  # decode -> looked at after each hand-over until

    def pulled(self, prefill: str, decode: str) -> None:
        """``decode`` took a hand-over from ``prefill`` (its pull is over, failed or not)."""
        self._window.setdefault(decode, Counter())[prefill] += 1

    def take(self, decode: str) -> Counter[str]:
        """The hand-overs ``decode`` took since the last look, as a look at it begins."""
        return self._window.pop(decode, Counter())

    def looked(self, decode: str, handovers: Counter[str], failed: int, now: float
               ) -> frozenset[str]:
        """A look at ``decode`` (begun after ``handovers``, from :meth:`take`) found ``failed``
        new failed pulls: blame pairs, clear the ones that pulled without failure, and watch
        the engine when it could not tell; returns the prefill engines blamed."""
        blamed = blame(handovers, failed)
        if failed and handovers and not blamed:
            self._watch[decode] = now + WATCH_S
        for prefill in handovers:
            key = (prefill, decode)
            if prefill in blamed:
                pair = self._pairs.setdefault(key, _Pair())
                backoff = pair.backoff_s or self._backoff_s
                pair.until, pair.blamed = now + backoff, pair.blamed + 1
                pair.backoff_s = min(2 * backoff, self._max_backoff_s)
                log.warning("KV pulls %s -> %s failed (%d of the %d hand-overs there since the "
                            "last look): routing around the pair for %.0f s", prefill, decode,
                            failed, sum(handovers.values()), backoff)
            elif failed == 0 and key in self._pairs:
                self._pairs[key].backoff_s = 0.0  # pulled cleanly: a fresh start
        return blamed

    def watching(self, decode: str, now: float) -> bool:
        """Whether ``decode`` is looked at after each hand-over (a look could not tell whose
        pulls failed: one hand-over a look tells)."""
        return now < self._watch.get(decode, 0.0)

    def usable(self, prefill: str, decode: str, now: float) -> bool:
        """Whether ``decode`` may be handed ``prefill``'s KV now."""
        pair = self._pairs.get((prefill, decode))
        return pair is None or now >= pair.until

    def forget(self, engine: str) -> None:
        """``engine`` came up (again): its pairs start clean."""
        self._pairs = {k: v for k, v in self._pairs.items() if engine not in k}
        self._window.pop(engine, None)
        self._watch.pop(engine, None)
        for window in self._window.values():
            window.pop(engine, None)

    def routed_around(self, now: float) -> list[dict[str, object]]:
        """The pairs left out now (``/pd/costs``)."""
        return [{"prefill": p, "decode": d, "for_s": round(pair.until - now, 1),
                 "times_blamed": pair.blamed}
                for (p, d), pair in sorted(self._pairs.items()) if now < pair.until]
