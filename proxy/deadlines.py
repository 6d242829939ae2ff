"""Per-stage deadlines for every remote call the proxy makes; one typed object, set at start-up."""

from __future__ import annotations

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

    def decode_headers_s(self, stream: bool, request_deadline: float | None, now: float
                         ) -> float:
        """How long a decode engine may take to its response headers: a whole reply's come
        with its last token, so it is bounded by the request's deadline (loop time) instead."""
        if stream or request_deadline is None:
            return self.headers_s
        return max(self.headers_s, request_deadline - now)

    def __post_init__(self) -> None:
        for name in ("prefill_s", "headers_s", "idle_s", "total_s", "handoff_max_age_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
