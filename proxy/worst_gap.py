"""The worst gap an arrival puts in the streams decoding on its decode engine, per route, fitted
from the arrivals the step tracker measured (``proxy/step_tracker.py``: the longest gap the
streams saw between the decode request and its first token).

The step fit (``StepFit``) prices a step on average; the decision needs the *worst* gap of an
arrival's window, and a window holds several steps, each with the box's jitter.

- A disaggregated arrival: the step fit prices a KV token spread over the hand-over's steps (the
  tracker splits an arrival's tokens between the gaps it overlaps), and putting every token on
  one step at that price over-predicted the worst gap (tiny, mixed goodput: measured /
  predicted 0.67-0.78; 1,023-token hand-overs predicted at 6-31 ms from one refit to the next).
- A local prefill: its chunk's step is priced by the step fit, but the worst gap of its window
  came out above it (tiny: 1.14-1.30).

So each route's worst gap is fitted as its excess over a plain prediction, ``a + b * tokens``
(KV tokens moved, or prompt tokens computed): least squares, recency-weighted, ``b >= 0``;
samples far off the first fit (a step stalled by something else) dropped and the rest
refitted once. ``b`` needs arrivals whose sizes spanned ``MIN_SPAN`` tokens; until then the
excess is a mean.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from proxy.estimators import recency_weights


class WorstGapFit:
    #: Arrivals measured before the fit is used.
    MIN_SAMPLES = 5
    #: Least range of arrival sizes (tokens) for the per-token term to be fitted.
    MIN_SPAN = 128.0

    def __init__(self, window: int = 64, half_life: float = 16.0):
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._half_life = half_life
        #: (excess fixed s, excess s per KV token), or None before ``MIN_SAMPLES``.
        self.fitted: tuple[float, float] | None = None

    @property
    def n_samples(self) -> int:
        return len(self._samples)

    def observe(self, tokens: int, excess_s: float) -> None:
        """An arrival of ``tokens`` whose worst gap was ``excess_s`` over its plain prediction."""
        if tokens <= 0:
            return
        self._samples.append((float(tokens), float(excess_s)))
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
