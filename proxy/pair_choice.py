"""Which pair of engines a request gets where engines serve both roles (``--layout pool``), with
latency targets: the targets rule is asked about each engine as the decode engine (the prefill
engine for it picked by least work, as always), and the pair that puts the fewest requests over
a target wins, then the least violation. Pure.

Then, among pairs that do equally well, the one whose decode engine already has streams: it
keeps another engine free of them, so the next long prompt can be prefilled there without
stalling anyone. Spreading the streams over every engine of the pool (least outstanding work)
left none free: every later prefill stalled some (tiny, prefill-heavy, goodput s44: the pool
at aggregated's level). This is disaggregation made on demand, and undone once packing the
streams is predicted to cost a target. Then the faster first token, then least work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from proxy.route_inputs import Decision

E = TypeVar("E")


@dataclass(frozen=True)
class PairOption(Generic[E]):
    decode: E
    prefill: E | None
    decision: Decision
    decode_streams: int  # streams decoding on the decode engine now (or about to)
    decode_work: float  # its outstanding work after this request (tokens: the usual pick)


def best_pair(options: Sequence[PairOption[E]]) -> PairOption[E]:
    def key(o: PairOption[E]) -> tuple[int, float, bool, float, float]:
        d = o.decision
        return (d.over_targets, round(d.violation, 9), o.decode_streams == 0,
                d.predicted_s() or 0.0, o.decode_work)
    return min(options, key=key)
