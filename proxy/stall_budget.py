"""The streams' stall budget, for the SLO rule (``proxy/policy.py``): pure arithmetic.

A gap target is each stream's p99 gap between tokens (nearest rank), so a stream may have a few
gaps over it (:func:`stall_allowance`). The ledger keeps what each request has left
(``proxy/ledger.py``); a route whose gap is over the target still meets it when every stream it
stalls has room for the steps it stalls them (:func:`stalls_needed`). Only the streams
decoding while those steps run are stalled (:func:`exposed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def stall_allowance(gaps: int) -> int:
    """Gaps over the target a stream of ``gaps`` gaps may have with its p99 gap (nearest
    rank: the ``ceil(0.99 n)``-th smallest) still within it: 2 of 255, 0 of 99."""
    return max(0, gaps - math.ceil(0.99 * gaps)) if gaps > 0 else 0


def stalls_needed(route: str, uncached_tokens: int, chunk_tokens: int) -> int:
    """Steps over the gap target a route puts on the streams when its gap is over it: a local
    prefill's chunks (each one step), or the one step that takes a disaggregated KV in."""
    if route == "disaggregated":
        return 1
    return max(1, -(-max(0, uncached_tokens) // max(1, chunk_tokens)))


@dataclass(frozen=True)
class Arrival:
    """A request bound to the decode engine that is not decoding there yet (its prompt is being
    prefilled elsewhere): a route's steps stall it only if it starts decoding before they end."""

    in_s: float  # seconds until its first token is expected on the decode engine
    room: int  # its stall room


def exposed(streams: int, room: int, arriving: tuple[Arrival, ...], within_s: float | None
            ) -> tuple[int, int]:
    """The streams a route's steps on the decode engine stall, and the least stall room among
    them: the ``streams`` decoding there now (the fewest room among them: ``room``), and the
    arrivals expected to start before the steps end (``within_s`` from now; None: all). A short
    local prefill ends before a long prompt prefilled elsewhere comes to decode (SmolLM2 mixed:
    64-token prompts sent to queue 1.6-4.5 s on the prefill engine, to spare such arrivals a
    stall they would not have seen)."""
    if not arriving:
        return streams, room if streams else 0
    late = [a for a in arriving if within_s is None or a.in_s < within_s]
    rooms = ([room] if streams else []) + [a.room for a in late]
    return streams + len(late), min(rooms, default=0)
