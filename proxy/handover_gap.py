"""The worst gap a KV hand-over puts in the streams decoding on its decode engine, fitted from
the hand-overs the step tracker measured (``proxy/step_tracker.py``: the longest gap the streams
saw between the decode request and its first token).

The step fit (``StepFit``) prices a KV token spread over the hand-over's steps: the tracker
splits an arrival's tokens between the gaps it overlaps. The decision needs the *worst* of those
gaps, and putting every token on one step at the spread price over-predicted it (tiny, mixed
goodput: measured / predicted 0.67-0.78 for disaggregated arrivals, 1,023-token hand-overs
predicted at 6-31 ms from one refit to the next). This fits the worst gap itself: its excess
over a plain step ``a + b * KV tokens`` (least squares, recency-weighted, ``b >= 0``; samples
far off the first fit, a step stalled by something else, dropped and the rest refitted once).
``b`` needs hand-overs whose sizes spanned ``MIN_SPAN`` tokens; until then the excess is a mean.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from proxy.estimators import recency_weights


class HandoverGapFit:
    #: Hand-overs measured before the fit stands in for the step fit's KV term.
    MIN_SAMPLES = 5
    #: Least range of hand-over sizes (tokens) for the per-token term to be fitted.
    MIN_SPAN = 128.0

    def __init__(self, window: int = 64, half_life: float = 16.0):
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._half_life = half_life
        #: (excess fixed s, excess s per KV token), or None before ``MIN_SAMPLES``.
        self.fitted: tuple[float, float] | None = None

    @property
    def n_samples(self) -> int:
        return len(self._samples)

    def observe(self, kv_tokens: int, excess_s: float) -> None:
        """A hand-over of ``kv_tokens`` whose worst gap was ``excess_s`` over a plain step."""
        if kv_tokens <= 0:
            return
        self._samples.append((float(kv_tokens), float(excess_s)))
        if len(self._samples) >= self.MIN_SAMPLES:
            self.fitted = self._fit()

    def _fit(self) -> tuple[float, float]:
        data = np.array(self._samples)
        tokens, y = data[:, 0], data[:, 1]
        w = recency_weights(len(y), self._half_life)
        keep = np.ones(len(y), dtype=bool)
        for _ in range(2):
            a, b = self._solve(tokens[keep], y[keep], w[keep])
            resid = np.abs(a + b * tokens - y)
            scale = max(float(np.median(resid[keep])), 1e-4)
            keep = resid <= np.maximum(3.0 * scale, 0.5 * np.abs(a + b * tokens))
            if keep.sum() < self.MIN_SAMPLES or keep.all():
                break
        return a, b

    def _solve(self, tokens: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
        mean = float(np.sum(w * y) / np.sum(w))
        if np.ptp(tokens) < self.MIN_SPAN:
            return mean, 0.0
        # The intercept may be negative (a plain step over-predicted), the slope may not.
        x = np.column_stack([np.ones(len(y)), tokens])
        sol, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
        if sol[1] < 0:
            return mean, 0.0
        return float(sol[0]), float(sol[1])
