"""Which prefill -> decode pairs can hand KV over: a pair whose pulls fail is routed around.

A decode engine that cannot read a prefill engine's KV serves the request anyway: it computes
the prompt itself (vLLM's ``kv_load_failure_policy=recompute``). The client sees only a slow
first token, and the prefill engine's work was wasted. Causes are per pair, and they last:
engines built from different vLLM, model path or dtype ("NIXL compatibility hash mismatch"), or
a pair that cannot reach each other's side channel or KV. Sent there again and again, every
such request pays a prefill twice.

The decode engine counts its failed pulls, not whose KV they were. Each hand-over is recorded
from the decode request's sending (:meth:`PairHealth.opened`) to its first byte or whole reply
(:meth:`PairHealth.pulled`: by then its pull has succeeded or failed). vLLM counts a failure
when it finds it, before the engine computes the prompt instead and answers, so a look at the
count (``Engine.update_load``, each probe's) can hold the failure of a hand-over still open.
:meth:`PairHealth.looked` lays the new failures on every hand-over open since the engine's
last look, or pulled since that look's read was sent (a pull over after the read was sent may
be in either count); :func:`blame` is the rule. A hand-over is settled, and dropped, once a
look's read was sent after it was pulled. A look that could not read the count settles
nothing (its failures are the next look's). When a look cannot tell whose pulls failed
(several pairs, and no way to split the failures), the decode engine is watched for a while:
looked at after each hand-over (``EnginePool.pulled``), so that a look holds few.

A blamed pair is left out of the picks for a backoff (10 s at first, doubling while it keeps
failing, up to 5 min: a failure found while the pair is left out is one of the hand-overs sent
before, and changes nothing). After the backoff, hand-overs go there again, and a look that
proves one clean (sent after the last look's answer, pulled before this look's read, no
failure) clears the pair. An engine that comes up (a restart, a new engine under the same name)
starts with a clean slate; a look under way meanwhile blames no one (its count may hold the old
engine's).

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


def blame(handovers: Mapping[str, int], failed: int, whole: bool = True) -> frozenset[str]:
    """The prefill engines whose hand-overs failed, from one look at a decode engine:
    ``handovers`` counts, per prefill engine, the hand-overs whose failures the look's count
    may hold; ``failed`` the new failures it found. ``whole``: every one of those hand-overs
    is over, and its failure (if any) in this count, none in an earlier one.

    The count can be lower than the requests that failed: vLLM counts a failed NIXL handshake
    once, however many requests waited on it (and KV whose lease ran out apart, not here).
    - Sure: a pair with more failures than all the other pairs' hand-overs (one pair alone,
      or as many failures as hand-overs: each pair).
    - Else, in a whole window, the one pair whose hand-overs are exactly the failures (its
      pulls all failed, the others' none). With no such pair, or two, or hand-overs still
      open (their failures may come later: the exact count says nothing), the look cannot
      tell and blames no one: a later look will, as the hand-overs of each window differ.
    """
    total = sum(handovers.values())
    if failed <= 0 or total == 0:
        return frozenset()
    sure = frozenset(p for p, n in handovers.items() if n > 0 and failed > total - n)
    if sure or not whole:
        return sure
    exact = [p for p, n in handovers.items() if n == failed]
    return frozenset(exact) if len(exact) == 1 else frozenset()


@dataclass
class Handover:
    """One hand-over to ``decode`` of ``prefill``'s KV: sent at ``opened``, its pull over at
    ``done`` (None: not yet), on the pool's monotonic clock."""
    prefill: str
    decode: str
    opened: float
    done: float | None = None


@dataclass(frozen=True)
class LookStart:
    """A look at a decode engine's count, as its read is sent."""
    sent: float
    epoch: int  # of the engines that came up: a look spanning one blames no one


@dataclass
class _Pair:
    #: Left out until this time (monotonic seconds); 0: never.
    until: float = 0.0
    #: The next backoff; 0 while the pair has not failed since it was last clear.
    backoff_s: float = 0.0
    #: Looks that blamed the pair, in all.
    blamed: int = 0


class PairHealth:
    #: Hand-overs kept per decode engine between looks (the oldest are dropped past it).
    MAX_OPEN = 4096

    def __init__(self, backoff_s: float = BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S):
        self._backoff_s, self._max_backoff_s = backoff_s, max_backoff_s
        self._open: dict[str, list[Handover]] = {}  # decode -> hand-overs not settled
        self._answered: dict[str, float] = {}  # decode -> when its last look was answered
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._watch: dict[str, float] = {}  # decode -> looked at after each hand-over until
        self._epoch = 0

    def opened(self, prefill: str, decode: str, now: float) -> Handover:
        """``decode`` is sent a hand-over of ``prefill``'s KV."""
        handover = Handover(prefill, decode, now)
        kept = self._open.setdefault(decode, [])
        kept.append(handover)
        del kept[:-self.MAX_OPEN]
        return handover

    def pulled(self, handover: Handover, now: float) -> bool:
        """The hand-over's pull is over, failed or not (its engine answered, or failed);
        returns whether its decode engine is watched."""
        if handover.done is None:
            handover.done = now
        return self.watching(handover.decode, now)

    def look_begins(self, decode: str, now: float) -> LookStart:
        return LookStart(now, self._epoch)

    def looked(self, decode: str, start: LookStart, failed: int, now: float) -> frozenset[str]:
        """A look at ``decode`` (its read sent at ``start``, answered ``now``) found ``failed``
        new failed pulls: blame pairs, clear the ones proven clean, settle the hand-overs
        pulled before the read, and watch the engine when it could not tell; returns the
        prefill engines blamed."""
        kept = self._open.get(decode, [])
        since = self._answered.get(decode, float("-inf"))
        self._answered[decode] = now
        handovers = Counter(h.prefill for h in kept)
        settled = [h for h in kept if h.done is not None and h.done <= start.sent]
        self._open[decode] = [h for h in kept if h.done is None or h.done > start.sent]
        whole = len(settled) == len(kept) and all(h.opened > since for h in kept)
        blamed = (blame(handovers, failed, whole) if start.epoch == self._epoch
                  else frozenset())
        if failed and handovers and not blamed:
            self._watch[decode] = now + WATCH_S
        for prefill in blamed:
            pair = self._pairs.setdefault((prefill, decode), _Pair())
            pair.blamed += 1
            if now < pair.until:
                continue  # a hand-over sent before it was left out: nothing new
            backoff = pair.backoff_s or self._backoff_s
            pair.until, pair.backoff_s = now + backoff, min(2 * backoff, self._max_backoff_s)
            log.warning("KV pulls %s -> %s failed (%d of the %d hand-overs there since the "
                        "last look): routing around the pair for %.0f s", prefill, decode,
                        failed, sum(handovers.values()), backoff)
        if failed == 0:
            for h in settled:
                if h.opened > since and (h.prefill, decode) in self._pairs:
                    self._pairs[(h.prefill, decode)].backoff_s = 0.0  # clean: a fresh start
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
        """``engine`` came up (again): its pairs start clean, its hand-overs are not counted,
        and a look under way blames no one."""
        self._epoch += 1
        self._pairs = {k: v for k, v in self._pairs.items() if engine not in k}
        self._open.pop(engine, None)
        self._answered.pop(engine, None)
        self._watch.pop(engine, None)
        for decode, kept in self._open.items():
            self._open[decode] = [h for h in kept if h.prefill != engine]

    def routed_around(self, now: float) -> list[dict[str, object]]:
        """The pairs left out now (``/pd/costs``)."""
        return [{"prefill": p, "decode": d, "for_s": round(pair.until - now, 1),
                 "times_blamed": pair.blamed}
                for (p, d), pair in sorted(self._pairs.items()) if now < pair.until]
