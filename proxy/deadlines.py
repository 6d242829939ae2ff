"""Per-stage deadlines for every remote call the proxy makes; one typed object, set at start-up."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Deadlines:
    """Seconds each stage may take before the proxy gives up on it.

    ``prefill_s``: the whole prefill leg (request sent → KV handoff received).
    ``first_byte_s``: decode request sent → response headers and first body bytes.
    ``idle_s``: longest silence between two chunks of a running stream.
    ``total_s``: the whole request, end to end.
    ``health_s``: one health or metrics probe.
    ``handoff_s``: how old a prefill hand-off may be when a decode engine is sent to read it
    (below the prefill engine's KV lease, after which its blocks may be reused).
    """

    prefill_s: float = 120.0
    first_byte_s: float = 120.0
    idle_s: float = 60.0
    total_s: float = 600.0
    health_s: float = 2.0
    handoff_s: float = 24.0

    def __post_init__(self) -> None:
        for name in ("prefill_s", "first_byte_s", "idle_s", "total_s", "health_s",
                     "handoff_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
