"""What one decode engine's steps cost, read off the streams the proxy relays from it.

A stream decoding there gets one token per engine step, so the gap between two of its frames
is a step (or ``frames`` steps, when a chunk carries several). The tracker takes the gaps of one
stream per engine (the oldest: every stream sees the same steps) and pairs each with the work
that ran on the engine meanwhile: prompt tokens computed there (a local prefill) and KV pulled
in (a disaggregated arrival), each known as an interval ``[sent, first byte]`` once it ends.
Work spread over several gaps (a chunked prefill) is split between them by overlap; the gap
holding the step that produced the arrival's first token may end just after it, so finished
work is kept a few seconds for gaps still to come. A gap becomes a sample ``(prefill tokens,
streams, KV tokens, seconds per step)`` for :class:`~proxy.step_fit.StepFit` once no work that
is still running started before its end.

For each arrival that ran beside streams, the longest gap they saw during it is reported with
the gap the decision predicted (``on_arrival``): the two sides of ``pd_itl_prediction_ratio``;
and with its route and size (``on_worst_gap``: ``proxy/worst_gap.py``).

No clock: every call carries its time (``time.perf_counter`` seconds). Call order per stream:
``stream_started`` → ``frame`` per relayed chunk → ``stream_ended``; per arrival:
``work_started`` → ``work_done`` or ``work_dropped``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

Sample = Callable[[float, float, float, float], None]
Arrival = Callable[[str, float | None, float], None]  # (route, predicted, measured)
WorstGap = Callable[[str, int, int, float], None]  # (route, tokens, streams, worst gap)
#: How long finished work stays attributable to gaps that end after it (several slow steps).
KEEP_DONE_S = 5.0


@dataclass
class _Gap:
    t0: float
    t1: float
    frames: int
    streams: int
    prefill_tokens: float = 0.0
    kv_tokens: float = 0.0


@dataclass
class _Work:
    t0: float
    predicted_gap_s: float | None = None
    route: str = ""
    t1: float = 0.0
    prefill_tokens: int = 0
    kv_tokens: int = 0
    worst_gap_s: float | None = None
    worst: _Gap | None = None  # the gap it was

    def claim(self, gap: _Gap) -> None:
        """Give ``gap`` its share of this (finished) work, by overlap."""
        overlap = min(gap.t1, self.t1) - max(gap.t0, self.t0)
        if overlap <= 0:
            return
        share = overlap / max(self.t1 - self.t0, 1e-9)
        gap.prefill_tokens += self.prefill_tokens * share
        gap.kv_tokens += self.kv_tokens * share
        seconds = (gap.t1 - gap.t0) / gap.frames
        if self.worst_gap_s is None or seconds > self.worst_gap_s:
            self.worst_gap_s, self.worst = seconds, gap


@dataclass
class StepTracker:
    """One decode engine's. ``sample`` gets each final ``(prefill, streams, kv, seconds)``."""

    sample: Sample
    on_arrival: Arrival | None = None
    #: Each arrival's route, tokens (KV moved, or prompt computed), the streams beside it and
    #: their worst gap.
    on_worst_gap: WorstGap | None = None
    max_pending: int = 4096
    _streams: dict[object, float] = field(default_factory=dict)  # stream -> last frame time
    _reporter: object | None = None
    #: Gaps and finished work, each in the order of its end time (``now`` only grows).
    _pending: deque[_Gap] = field(default_factory=deque)
    _running: dict[object, _Work] = field(default_factory=dict)
    _done: deque[_Work] = field(default_factory=deque)

    @property
    def streams(self) -> int:
        return len(self._streams)

    def stream_started(self, stream: object, now: float) -> None:
        self._streams[stream] = now
        if self._reporter is None:
            self._reporter = stream

    def frame(self, stream: object, now: float, frames: int = 1) -> None:
        last = self._streams.get(stream)
        if last is None:
            return
        self._streams[stream] = now
        if stream is not self._reporter or frames <= 0 or now <= last:
            return
        gap = _Gap(last, now, frames, len(self._streams))
        for work in reversed(self._done):  # by end time: the rest ended before this gap began
            if work.t1 <= gap.t0:
                break
            work.claim(gap)
        self._pending.append(gap)
        if len(self._pending) > self.max_pending:
            self._pending.popleft()
        self._flush(now)

    def stream_ended(self, stream: object) -> None:
        self._streams.pop(stream, None)
        if stream is self._reporter:  # the next oldest reports from its next frame on
            self._reporter = next(iter(self._streams), None)

    def work_started(self, work: object, now: float, predicted_gap_s: float | None = None,
                     route: str = "") -> None:
        self._running[work] = _Work(now, predicted_gap_s, route)

    def work_done(self, work: object, now: float, prefill_tokens: int = 0,
                  kv_tokens: int = 0) -> None:
        """The arrival ``work`` reached its first byte at ``now``."""
        done = self._running.pop(work, None)
        if done is None:
            return
        done.t1, done.prefill_tokens, done.kv_tokens = now, prefill_tokens, kv_tokens
        for gap in reversed(self._pending):  # by end time: the rest ended before it began
            if gap.t1 <= done.t0:
                break
            done.claim(gap)
        self._done.append(done)
        self._flush(now)

    def work_dropped(self, work: object, now: float) -> None:
        """``work`` ended with no first byte (a whole reply, a retry, a timeout): its share of
        the steps it spanned is not known, so those gaps are no sample."""
        dropped = self._running.pop(work, None)
        if dropped is not None:
            self._pending = deque(g for g in self._pending if g.t1 <= dropped.t0)
        self._flush(now)

    def _flush(self, now: float) -> None:
        """Samples from the gaps no running work can still claim a share of; arrivals whose
        time for late gaps is over are reported."""
        horizon = min((w.t0 for w in self._running.values()), default=float("inf"))
        pending = self._pending  # by end time: the ones before the horizon are at the left
        while pending and pending[0].t1 < horizon:
            gap = pending.popleft()
            self.sample(gap.prefill_tokens / gap.frames, gap.streams,
                        gap.kv_tokens / gap.frames, (gap.t1 - gap.t0) / gap.frames)
        while self._done and self._done[0].t1 + KEEP_DONE_S < now:
            work = self._done.popleft()
            if work.worst_gap_s is not None and self.on_arrival is not None:
                self.on_arrival(work.route, work.predicted_gap_s, work.worst_gap_s)
            if work.worst is not None and self.on_worst_gap is not None:
                self._report_worst(work, work.worst, self.on_worst_gap)

    @staticmethod
    def _report_worst(work: _Work, worst: _Gap, report: WorstGap) -> None:
        """An arrival's worst gap, unless it is another's: a hand-over's worst step carrying a
        local prefill, a local prefill's carrying a hand-over."""
        tokens, other = ((work.kv_tokens, worst.prefill_tokens) if work.kv_tokens
                         else (work.prefill_tokens, worst.kv_tokens))
        if tokens and not other:
            report("disaggregated" if work.kv_tokens else "local", tokens, worst.streams,
                   work.worst_gap_s or 0.0)
