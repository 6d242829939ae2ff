"""The load-or-recompute cost model: predicted time to first token on each route.

    disaggregated = prefill queue + prefill(uncached on prefill) + hand-over(tokens moved)
    local         = decode queue  + local prefill(uncached on decode)

``prefill(n)`` and ``local prefill(n)`` are fitted per engine from observed prefills (latency
grows faster than linearly with n: attention is quadratic); ``hand-over(n)`` = link fixed cost +
n x KV bytes per token / link bandwidth, fitted from observed hand-overs. This module holds the
pure formulas; the fitted numbers come from ``proxy/estimators.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillModel:
    """Seconds to prefill ``n`` new tokens: ``fixed_s + n / tokens_per_s + quad_s * n^2``."""

    fixed_s: float
    tokens_per_s: float
    quad_s: float = 0.0

    def seconds(self, n_tokens: int) -> float:
        if n_tokens <= 0:
            return 0.0
        return self.fixed_s + n_tokens / self.tokens_per_s + self.quad_s * n_tokens * n_tokens


@dataclass(frozen=True)
class LinkModel:
    """Seconds to hand ``n`` tokens of KV from prefill to decode: ``fixed_s + bytes / bandwidth``.

    ``fixed_s`` covers everything per request that does not scale with size (the NIXL
    notification, engine-step alignment, the decode request itself and its first step).
    """

    fixed_s: float
    bytes_per_s: float

    def seconds(self, n_tokens: int, kv_bytes_per_token: int) -> float:
        return self.fixed_s + n_tokens * kv_bytes_per_token / self.bytes_per_s


@dataclass(frozen=True)
class StepModel:
    """Seconds one decode engine's step takes: ``fixed_s + prefill_s * n + prefill_quad_s * n^2
    (n: prefill tokens in the step) + stream_s * streams decoding + kv_in_s * KV tokens pulled
    in meanwhile`` (the shape of DistServe's simulator and Dynamo's regression model, with the
    prefill term in the local prefill model's own shape, attention making a token of a long
    chunk dearer than one of a short chunk, plus a term for the CPU a KV pull takes from the
    steps on a CPU engine). Streams decoding there wait one step per token: a step that also
    computes a prompt chunk is a longer gap between their tokens."""

    fixed_s: float
    prefill_s: float
    stream_s: float
    kv_in_s: float = 0.0
    prefill_quad_s: float = 0.0
    #: The worst gap a KV hand-over puts in the streams beyond a plain step, fitted from the
    #: hand-overs' own worst gaps (``proxy/worst_gap.py``): ``handover_fixed_s +
    #: handover_s * KV tokens``. None until fitted: ``kv_in_s`` on one step stands in.
    handover_fixed_s: float | None = None
    handover_s: float = 0.0
    #: The same for a local prefill, beyond its chunk's step: ``local_fixed_s + local_s *
    #: prompt tokens`` (0 until fitted).
    local_fixed_s: float = 0.0
    local_s: float = 0.0

    def prefill_seconds(self, prefill_tokens: int) -> float:
        """What a chunk of ``prefill_tokens`` adds to the step."""
        n = max(0, prefill_tokens)
        return self.prefill_s * n + self.prefill_quad_s * n * n

    def seconds(self, prefill_tokens: int = 0, streams: int = 0, kv_tokens: int = 0) -> float:
        return (self.fixed_s + self.prefill_seconds(prefill_tokens)
                + self.stream_s * max(0, streams) + self.kv_in_s * max(0, kv_tokens))

    def local_gap(self, prompt_tokens: int, chunk_tokens: int, streams: int) -> float:
        """The longest gap ``streams`` decoding here see while a prompt of ``prompt_tokens`` is
        computed here in chunks of ``chunk_tokens``: the largest chunk's step, and the rest."""
        step = self.seconds(min(prompt_tokens, chunk_tokens), streams)
        # (The fitted excess may be negative at this size: the step is the least it can be.)
        return max(step, step + self.local_fixed_s + self.local_s * max(0, prompt_tokens))

    def handover_gap(self, streams: int, kv_tokens: int) -> float:
        """The longest gap ``streams`` decoding here see while ``kv_tokens`` of KV come in."""
        if self.handover_fixed_s is None:
            return self.seconds(0, streams, kv_tokens)
        step = self.seconds(0, streams)  # (at least a plain step, as above)
        return max(step, step + self.handover_fixed_s + self.handover_s * max(0, kv_tokens))


def breakeven_bytes_per_s(kv_bytes_per_token: int, prefill_tokens_per_s: float) -> float:
    """Link bandwidth at which moving a token's KV costs as much as recomputing it."""
    return kv_bytes_per_token * prefill_tokens_per_s


def crossover_tokens(
    kv_bytes_per_token: int,
    link: LinkModel,
    remote_prefill: PrefillModel,
    local_prefill: PrefillModel,
    max_tokens: int = 1_000_000,
) -> int | None:
    """Smallest prompt length at which disaggregating (remote prefill + transfer) beats a local
    prefill, with idle queues; None if it never does up to ``max_tokens``.

    Searches by doubling then bisection: the cost difference is monotone once transfer wins when
    both prefill models share a shape, and near-monotone otherwise (good enough for planning).
    """

    def disagg_wins(n: int) -> bool:
        return remote_prefill.seconds(n) + link.seconds(n, kv_bytes_per_token) < (
            local_prefill.seconds(n)
        )

    hi = 1
    while not disagg_wins(hi):
        hi *= 2
        if hi > max_tokens:
            return None
    lo = hi // 2
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if disagg_wins(mid):
            hi = mid
        else:
            lo = mid
    return hi
