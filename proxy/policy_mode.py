"""A routing policy's name: ``auto``, ``disaggregate``, ``local`` or ``threshold:N`` (what each
decides: ``proxy/policy.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class PolicyMode:
    kind: Literal["auto", "disaggregate", "local", "threshold"]
    threshold_tokens: int = 0

    def __str__(self) -> str:
        return f"threshold:{self.threshold_tokens}" if self.kind == "threshold" else self.kind


def parse_policy(text: str) -> PolicyMode:
    """Parse ``auto``, ``disaggregate`` (also spelled ``disaggregated``, the route it always
    picks), ``local`` or ``threshold:N``; raise ValueError otherwise."""
    if text == "disaggregated":
        text = "disaggregate"
    if text in ("auto", "disaggregate", "local"):
        return PolicyMode(text)  # type: ignore[arg-type]
    if text.startswith("threshold:"):
        n = int(text.split(":", 1)[1])
        if n < 0:
            raise ValueError("threshold must be >= 0")
        return PolicyMode("threshold", n)
    raise ValueError(f"unknown policy {text!r} (auto, disaggregate, local, threshold:N)")
