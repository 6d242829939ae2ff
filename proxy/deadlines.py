"""Per-stage deadlines for every remote call the proxy makes; one typed object, set at start-up."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadlines:
    """Seconds each stage may take before the proxy gives up on it.

    ``prefill_s``: the whole prefill leg (request sent → KV handoff received).
    ``headers_s``: decode request sent → its response headers (``--headers-deadline-s``).
    ``idle_s``: longest silence between two chunks of a running stream.
    ``total_s``: the whole request, end to end.
    ``handoff_max_age_s``: how old a prefill hand-off may be when a decode engine is sent to read it
    (below the prefill engine's KV lease, after which its blocks may be reused).
    """

    prefill_s: float = 120.0
    headers_s: float = 120.0
    idle_s: float = 60.0
    total_s: float = 600.0
    handoff_max_age_s: float = 24.0

    def decode_headers_s(self, stream: bool, request_deadline: float | None) -> float:
        """How long a decode engine may take to its response headers, within the request's
        deadline (``loop.time()``): a whole reply's come with its last token, so it has the
        request's deadline alone."""
        return min(self.headers_s if stream else math.inf, seconds_left(request_deadline))

    def __post_init__(self) -> None:
        for name in ("prefill_s", "headers_s", "idle_s", "total_s", "handoff_max_age_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


def seconds_left(deadline: float | None) -> float:
    """Seconds to a request's ``deadline`` (``loop.time()``; None: it has none). Each stage's
    own deadline is cut to it: no stage runs a request past its end."""
    return math.inf if deadline is None else deadline - asyncio.get_running_loop().time()
