"""Which route a request takes: a pure function of what the proxy knows when the request arrives.

``disaggregated``: prefill engine computes the prompt, decode pulls its KV over NIXL.
``local``: the decode engine computes the prompt itself (no KV moves).

Modes: ``disaggregate`` (always, when a prefill engine is up), ``local`` (never), and
``threshold:N`` (disaggregate when the uncached prompt is at least N tokens, the llm-d / Dynamo
rule). The decision reads no clock and does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Route = Literal["disaggregated", "local"]


@dataclass(frozen=True)
class PolicyMode:
    kind: Literal["disaggregate", "local", "threshold"]
    threshold_tokens: int = 0

    def __str__(self) -> str:
        return f"threshold:{self.threshold_tokens}" if self.kind == "threshold" else self.kind


def parse_policy(text: str) -> PolicyMode:
    """Parse ``disaggregate``, ``local`` or ``threshold:N``; raise ValueError otherwise."""
    if text in ("disaggregate", "local"):
        return PolicyMode(text)  # type: ignore[arg-type]
    if text.startswith("threshold:"):
        n = int(text.split(":", 1)[1])
        if n < 0:
            raise ValueError("threshold must be >= 0")
        return PolicyMode("threshold", n)
    raise ValueError(f"unknown policy {text!r} (disaggregate, local, threshold:N)")


@dataclass(frozen=True)
class RouteInputs:
    """What is known about one request and the engines that could serve it."""

    prompt_tokens: int
    decode_cached_tokens: int = 0
    prefill_available: bool = True


@dataclass(frozen=True)
class Decision:
    route: Route
    reason: str


def decide(mode: PolicyMode, inputs: RouteInputs) -> Decision:
    if not inputs.prefill_available:
        return Decision("local", "prefill_unavailable")
    if mode.kind == "local":
        return Decision("local", "policy_local")
    if mode.kind == "disaggregate":
        return Decision("disaggregated", "policy_disaggregate")
    uncached = max(0, inputs.prompt_tokens - inputs.decode_cached_tokens)
    if uncached >= mode.threshold_tokens:
        return Decision("disaggregated", "over_threshold")
    return Decision("local", "under_threshold")
