"""Which route a request takes: a pure function of what the proxy knows when the request arrives.

``disaggregated``: prefill engine computes the prompt, decode pulls its KV over NIXL.
``local``: the decode engine computes the prompt itself (no KV moves).

Modes: ``auto`` (the cheaper predicted time to first token, from the live cost model),
``disaggregate`` (always, when a prefill engine is up), ``local`` (never), and ``threshold:N``
(disaggregate when the uncached prompt is at least N tokens, the llm-d / Dynamo rule).
The decision reads no clock and does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from transport.cost import LinkModel, PrefillModel

Route = Literal["disaggregated", "local"]


@dataclass(frozen=True)
class PolicyMode:
    kind: Literal["auto", "disaggregate", "local", "threshold"]
    threshold_tokens: int = 0

    def __str__(self) -> str:
        return f"threshold:{self.threshold_tokens}" if self.kind == "threshold" else self.kind


def parse_policy(text: str) -> PolicyMode:
    """Parse ``auto``, ``disaggregate``, ``local`` or ``threshold:N``; raise ValueError otherwise."""
    if text in ("auto", "disaggregate", "local"):
        return PolicyMode(text)  # type: ignore[arg-type]
    if text.startswith("threshold:"):
        n = int(text.split(":", 1)[1])
        if n < 0:
            raise ValueError("threshold must be >= 0")
        return PolicyMode("threshold", n)
    raise ValueError(f"unknown policy {text!r} (auto, disaggregate, local, threshold:N)")


@dataclass(frozen=True)
class CostInputs:
    """The live cost model for one prefill->decode pair (fitted by ``proxy/estimators.py``)."""

    kv_bytes_per_token: int
    remote_prefill: PrefillModel  # the prefill engine computing a prompt
    local_prefill: PrefillModel  # the decode engine computing a prompt itself
    link: LinkModel  # hand-over: prefill done -> decode's first token
    prefill_queue_s: float = 0.0  # work already queued on the prefill engine
    decode_queue_s: float = 0.0  # prompt work already queued on the decode engine


@dataclass(frozen=True)
class RouteInputs:
    """What is known about one request and the engines that could serve it."""

    prompt_tokens: int
    prefill_cached_tokens: int = 0
    decode_cached_tokens: int = 0
    prefill_available: bool = True
    costs: CostInputs | None = None


@dataclass(frozen=True)
class Decision:
    route: Route
    reason: str
    predicted_disaggregated_s: float | None = None
    predicted_local_s: float | None = None

    def predicted_s(self) -> float | None:
        return self.predicted_disaggregated_s if self.route == "disaggregated" else (
            self.predicted_local_s
        )


def predict(inputs: RouteInputs, costs: CostInputs) -> tuple[float, float]:
    """Predicted seconds to first token: (disaggregated, local)."""
    n = inputs.prompt_tokens
    remote_new = max(0, n - inputs.prefill_cached_tokens)
    local_new = max(0, n - inputs.decode_cached_tokens)
    moved = local_new  # decode loads its own cached prefix and pulls only the rest
    disagg = (
        costs.prefill_queue_s
        + costs.remote_prefill.seconds(remote_new)
        + costs.link.seconds(moved, costs.kv_bytes_per_token)
    )
    local = costs.decode_queue_s + costs.local_prefill.seconds(local_new)
    return disagg, local


def decide(mode: PolicyMode, inputs: RouteInputs) -> Decision:
    predicted: tuple[float | None, float | None] = (None, None)
    if inputs.costs is not None:
        predicted = predict(inputs, inputs.costs)

    def made(route: Route, reason: str) -> Decision:
        return Decision(route, reason, *predicted)

    if not inputs.prefill_available:
        return made("local", "prefill_unavailable")
    if mode.kind == "local":
        return made("local", "policy_local")
    if mode.kind == "disaggregate":
        return made("disaggregated", "policy_disaggregate")
    uncached = max(0, inputs.prompt_tokens - inputs.decode_cached_tokens)
    if mode.kind == "threshold":
        if uncached >= mode.threshold_tokens:
            return made("disaggregated", "over_threshold")
        return made("local", "under_threshold")
    # auto
    if inputs.costs is None:
        return made("disaggregated", "no_cost_model")
    if uncached == 0:
        return made("local", "cached_on_decode")
    disagg_s, local_s = predicted
    assert disagg_s is not None and local_s is not None
    if disagg_s < local_s:
        return made("disaggregated", "transfer_cheaper")
    if inputs.costs.prefill_queue_s > inputs.costs.decode_queue_s and (
        disagg_s - inputs.costs.prefill_queue_s < local_s
    ):
        return made("local", "prefill_congested")
    return made("local", "recompute_cheaper")
