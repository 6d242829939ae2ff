"""What this proxy has outstanding on each engine, kept by the requests that put it there.

Each request holds a :class:`Claim` on each engine it uses: prompt tokens the engine is to
compute for it (a prefill leg, or the decode engine's local prefill), the output budget it may
still generate there (its ``max_tokens`` minus what was relayed), and one request in flight.
Routing reads the sums (:meth:`Ledger.load`, ``Engine.inflight``); the cost model reads the
queued prompt tokens. A claim is the only way these numbers change:

    claim = ledger.claim(engine, prompt_tokens=n, output_tokens=m)   # or `with ...:`
    claim.add_prompt(k)      # more prompt work there (a local prefill after a failed prefill)
    claim.prompt_done()      # the engine has computed the prompt (its first byte, or the reply)
    claim.output_done(k)     # k tokens relayed (None: the rest)
    claim.move_to(other)     # the request goes to another engine (a retry): what is left moves
    claim.release()          # everything left; idempotent, and what ``with`` does on exit
    claim.stalled()          # one more gap over the request's gap target (its stall budget)
    claim.hold_stalls(n)     # its route will stall the others there n times: held from their
                             # room until its first byte (drop_hold) or its release
    claim.expect_start(at)   # prefilled elsewhere: its first token is due here at `at`

A request with a gap target (``itl_s``) may have ``stall_allowance(gaps)`` gaps over it and keep
its p99 gap within it; :meth:`Ledger.stall_room` is the fewest still left among the requests on
an engine (what a route that stalls them all may spend).

Release is idempotent and the counts never go below zero, so a claim released in a ``finally``
after a partial release is safe. Not thread-safe: used on the event loop.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from proxy.pool import Engine
from proxy.stall_budget import Arrival, stall_allowance


@dataclass
class EngineLoad:
    """One engine's outstanding work from this proxy."""

    prompt_tokens: int = 0  # prompt tokens queued for computing there
    output_tokens: int = 0  # output budgets of the requests decoding there
    requests: int = 0  # requests in flight there


class Ledger:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._loads: dict[str, EngineLoad] = defaultdict(EngineLoad)
        self._claims: dict[str, set[Claim]] = defaultdict(set)  # the open claims per engine
        self.clock = clock
        #: When each engine last finished (or dropped) a prompt of this proxy's.
        self._prompt_ended: dict[str, float] = {}

    def load(self, engine: str) -> EngineLoad:
        """``engine``'s current load (a live view: do not change it)."""
        return self._loads[engine]

    def loads(self) -> dict[str, EngineLoad]:
        return dict(self._loads)

    def claim(self, engine: Engine, *, prompt_tokens: int = 0, output_tokens: int = 0,
              itl_s: float | None = None, stream: bool = True) -> Claim:
        """``itl_s``: the request's gap target (its stall budget counts gaps over it);
        ``stream``: False for a whole reply (its client sees no gap between tokens)."""
        return Claim(self, engine, prompt_tokens, output_tokens, itl_s, stream)

    def queued_prompts(self, engine: str) -> tuple[list[int], float]:
        """The prompt work queued on ``engine``, one entry per request (oldest first), and how
        long the oldest has been computed: since it was queued, or since the prompt before it
        there ended (an engine computes what it was sent in turn)."""
        claims = self._claims.get(engine)
        if not claims:
            return [], 0.0
        pending = sorted((c for c in claims if c.prompt_tokens),
                         key=lambda c: c.prompt_at)
        if not pending:
            return [], 0.0
        started = max(pending[0].prompt_at, self._prompt_ended.get(engine, -math.inf))
        return [c.prompt_tokens for c in pending], max(0.0, self.clock() - started)

    def stall_room(self, engine: str) -> int:
        """Gaps over its target that every request decoding on ``engine`` (or bound to) can
        still take (0 when one has no gap target: its gaps are not known to tolerate any)."""
        return min((c.stall_room for c in self._claims[engine] if c.streaming), default=0)

    def bound(self, engine: str) -> int:
        """This proxy's streams decoding on ``engine``, due to, or expected there later."""
        return sum(1 for c in self._claims.get(engine, ()) if c.streaming)

    def decoding(self, engine: str, now: float) -> int:
        """This proxy's streams decoding on ``engine`` now, or due to (not ones whose first
        token is expected there later: ``expect_start``); a prefill leg's claim decodes none,
        a whole reply streams none."""
        return sum(1 for c in self._claims.get(engine, ()) if c.streaming
                   and (c.starts_at is None or c.starts_at <= now))

    def exposure(self, engine: str, now: float) -> tuple[int, tuple[Arrival, ...]]:
        """The fewest stalls the requests decoding on ``engine`` now (or due to) can still
        take, and the ones bound there whose first token is expected later (``expect_start``):
        how far off each is and its room. ``now``: the monotonic clock."""
        claims = self._claims.get(engine)
        if not claims:
            return 0, ()
        decoding = [c for c in claims if c.streaming]
        later = [c for c in decoding if c.starts_at is not None and c.starts_at > now]
        room = min((c.stall_room for c in decoding if c not in later), default=0)
        assert all(c.starts_at is not None for c in later)
        arriving = tuple(sorted((Arrival(c.starts_at - now, c.stall_room)  # type: ignore[operator]
                                 for c in later), key=lambda a: a.in_s))
        return room, arriving

    def _add(self, engine: Engine, prompt: int, output: int, requests: int) -> None:
        load = self._loads[engine.name]
        load.prompt_tokens = max(0, load.prompt_tokens + prompt)
        load.output_tokens = max(0, load.output_tokens + output)
        load.requests = max(0, load.requests + requests)
        # Per object: a restarted engine is a new one under the same name (``pool.reconcile``),
        # and requests still running on the old one end on the old one.
        engine.inflight = max(0, engine.inflight + requests)


class Claim:
    """One request's share of one engine's load (see the module docstring)."""

    def __init__(self, ledger: Ledger, engine: Engine, prompt_tokens: int, output_tokens: int,
                 itl_s: float | None = None, stream: bool = True):
        self._ledger = ledger
        self.engine = engine
        self.prompt_tokens = 0
        self.prompt_at = 0.0  # when its prompt work was queued (the ledger's clock)
        self.output_tokens = max(0, output_tokens)
        self._open = True
        #: The request's gap target, and the gaps over it it may have (its budget's gaps).
        self.itl_s = itl_s
        self._allowance = stall_allowance(self.output_tokens - 1) if itl_s else 0
        self.stalls = 0
        #: Stalls other requests' routes are about to put on this one (not yet relayed).
        self.held = 0
        self._holding: tuple[list[Claim], int] = ([], 0)
        #: The request streams tokens from there (an output budget, streamed): the gaps a
        #: route puts there are its client's. A prefill leg's claim streams nothing, nor does a
        #: whole reply (its client sees no gap between tokens).
        self.streaming = self.output_tokens > 0 and stream
        #: When its first token is expected there, while its prompt is prefilled on another
        #: engine (monotonic clock; None: decoding, or due to).
        self.starts_at: float | None = None
        #: The engine had none of this proxy's prompt work when this claim's prompt arrived:
        #: a timing taken now measures the work alone (queueing would bias a fit).
        self.was_idle = True
        ledger._add(engine, 0, self.output_tokens, 1)
        ledger._claims[engine.name].add(self)
        if prompt_tokens:
            self.add_prompt(prompt_tokens)

    def add_prompt(self, tokens: int) -> bool:
        """Queue ``tokens`` of prompt work on the engine; True when it had none queued."""
        self.was_idle = self._ledger.load(self.engine.name).prompt_tokens == 0
        tokens = max(0, tokens)
        if self._open and tokens:
            if not self.prompt_tokens:
                self.prompt_at = self._ledger.clock()
            self.prompt_tokens += tokens
            self._ledger._add(self.engine, tokens, 0, 0)
        return self.was_idle

    def prompt_done(self) -> None:
        if self.prompt_tokens:
            self._ledger._add(self.engine, -self.prompt_tokens, 0, 0)
            self.prompt_tokens = 0
            self._ledger._prompt_ended[self.engine.name] = self._ledger.clock()

    def output_done(self, tokens: int | None = None) -> None:
        n = self.output_tokens if tokens is None else min(max(0, tokens), self.output_tokens)
        if n:
            self.output_tokens -= n
            self._ledger._add(self.engine, 0, -n, 0)

    def move_to(self, engine: Engine) -> None:
        """What is left of this claim now weighs on ``engine`` instead."""
        if not self._open or engine is self.engine:
            return
        prompt, output, held = self.prompt_tokens, self.output_tokens, self._holding[1]
        self.drop_hold()  # the stalls its steps put on the old engine's streams: on the new's
        self._ledger._add(self.engine, -prompt, -output, -1)
        self._ledger._claims[self.engine.name].discard(self)
        self._ledger._claims[engine.name].add(self)
        self.engine = engine
        if prompt:
            self.was_idle = self._ledger.load(engine.name).prompt_tokens == 0
            self.prompt_at = self._ledger.clock()  # queued anew there
        self._ledger._add(engine, prompt, output, 1)
        if held:
            self.hold_stalls(held)

    def release(self) -> None:
        if self._open:
            if self.prompt_tokens:
                self._ledger._prompt_ended[self.engine.name] = self._ledger.clock()
            self._ledger._add(self.engine, -self.prompt_tokens, -self.output_tokens, -1)
            self.prompt_tokens = self.output_tokens = 0
            self._open = False
            self._ledger._claims[self.engine.name].discard(self)
            self.drop_hold()

    @property
    def stall_room(self) -> int:
        """Gaps over the target this request can still take (0 without a target)."""
        return max(0, self._allowance - self.stalls - self.held)

    def expect_start(self, at: float | None) -> None:
        """Its prompt is prefilled elsewhere and its first token expected here at ``at`` (None:
        it is decoding, or its KV is on its way)."""
        self.starts_at = at

    def stalled(self) -> None:
        self.stalls += 1

    def hold_stalls(self, n: int, until: float | None = None) -> None:
        """This request's route is to stall every other request decoding on its engine ``n``
        times (its steps come before its first byte): held from their room meanwhile, so that
        a second arrival cannot spend the same stall before the gap is relayed. ``until``: when
        its steps end; a request due to start decoding later is not stalled by them."""
        others = [c for c in self._ledger._claims[self.engine.name]
                  if c.streaming and c is not self
                  and (until is None or c.starts_at is None or c.starts_at <= until)]
        for c in others:
            c.held += n
        self._holding = (others, n)

    def drop_hold(self) -> None:
        others, n = self._holding
        for c in others:
            c.held = max(0, c.held - n)
        self._holding = ([], 0)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
