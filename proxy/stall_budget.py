"""The streams' stall budget, for the SLO rule (``proxy/policy.py``): pure arithmetic.

A gap target is each stream's p99 gap between tokens (nearest rank), so a stream may have a few
gaps over it (:func:`stall_allowance`). The ledger keeps what each request has left
(``proxy/ledger.py``); a route whose gap is over the target still meets it when every stream it
stalls has room for the steps it stalls them (:func:`stalls_needed`).
"""

from __future__ import annotations

import math


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
