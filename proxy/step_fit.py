"""One decode engine's step time, fitted from the gaps between tokens the proxy relays:
:class:`StepFit` (``fixed + prefill tokens + streams + KV pulled``, ``transport.cost.StepModel``),
fed by ``proxy/step_tracker.py``. Unlike the window fits of ``proxy/estimators.py``, it reads a
clock: its refits are throttled once warm.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from proxy.estimators import nonneg_lstsq, recency_weights
from transport.cost import StepModel


class StepFit:
    """Seconds per decode step on one engine, ``StepModel``: least squares (non-negative,
    recency-weighted) over the recent (prefill tokens, streams, KV tokens, seconds) samples of
    ``proxy/step_tracker.py``. The prefill term keeps the prior's shape (the engine's local
    prefill model: linear and quadratic in the chunk's tokens) and the fit scales it: steps that
    carried 1,023-token chunks then also price a 64-token one, where a straight line through
    them priced it 1.4x too high. A term whose input never varied in the window (no local
    prefill seen yet, say) keeps the prior's coefficient: it cannot be told apart from the fixed
    cost. Samples whose residual is far off the first fit (a step stalled by something else) are
    dropped and the rest refitted once. Refits each time the samples have doubled, then every
    ``refit_every`` (32, half the half-life), at most once each ``refit_interval_s`` of
    ``clock``: a refit costs 0.2 ms of numpy alone and ~0.7 ms inside a busy proxy, on the path
    of the request whose bytes produced the sample, and a proxy relaying thousands of gaps a
    second refitted 30 times a second (3 % of requests 0.7 ms late: its p99 TTFT).

    A term counts as seen only when its input spanned ``MIN_SPAN`` in the window: the few prompt
    tokens of streams starting beside each other say nothing about a 1,500-token prefill, and a
    coefficient fitted from them would be extrapolated a hundredfold."""

    #: Least range of (prefill tokens, streams, KV tokens) for a term's coefficient to be used.
    MIN_SPAN = (128.0, 2.0, 128.0)
    #: Least number of samples that had prefill tokens, or KV tokens, for that term to be used:
    #: one sample alone is fitted exactly, whatever else slowed its step. A KV pull that ran
    #: beside a 512-token local prefill once set the KV term to 9 ms a token (a 1,023-token
    #: hand-over then predicted to stall the streams 9.5 s, SmolLM2).
    MIN_SEEN = 3

    def __init__(self, window: int = 256, min_samples: int = 8, half_life: float = 64.0,
                 refit_every: int = 32, refit_interval_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self._samples: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._min = min_samples
        self._half_life = half_life
        self._every = refit_every
        self._interval_s = refit_interval_s
        self._clock = clock
        self._fit_at = -math.inf
        #: Coefficients (fixed, prefill scale, stream, KV), which were fitted, and the prefill
        #: shape (per token, per token squared) the scale applies to.
        self._fitted: tuple[np.ndarray, tuple[bool, ...], tuple[float, float]] | None = None
        self._since_fit = 0
        #: The prefill shape of the last prior asked with: the next refit's.
        self._shape = (1.0, 0.0)
        #: The last :meth:`model` answer and its prior (the plan asks for it on every request;
        #: it changes only at a refit).
        self._model: tuple[StepModel, StepModel] | None = None

    @property
    def n_samples(self) -> int:
        return len(self._samples)

    def observe(self, prefill_tokens: float, streams: float, kv_tokens: float,
                seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds > 0):
            return
        self._samples.append((float(prefill_tokens), float(streams), float(kv_tokens),
                              float(seconds)))
        self._since_fit += 1
        # Early on, each time the window has doubled; then every ``refit_every`` samples.
        due = min(self._every, len(self._samples) - self._since_fit)
        if self._fitted is None or self._since_fit >= due and (
                due < self._every or self._clock() - self._fit_at >= self._interval_s):
            self._refit()

    def model(self, prior: StepModel) -> StepModel:
        """The fitted model, with ``prior``'s coefficient for every term not seen varying (the
        whole prior until ``min_samples`` samples). The prior's prefill shape is the one the
        next refit scales (not refitted here: the plan asks on every request)."""
        if prior.prefill_s > 0 or prior.prefill_quad_s > 0:
            self._shape = (prior.prefill_s, prior.prefill_quad_s)
        if self._fitted is None:
            return prior
        if self._model is not None and (self._model[0] is prior or self._model[0] == prior):
            return self._model[1]
        coef, free, (per_token, per_token2) = self._fitted
        scale = float(coef[1])
        model = StepModel(
            fixed_s=float(coef[0]),
            prefill_s=scale * per_token if free[1] else prior.prefill_s,
            prefill_quad_s=scale * per_token2 if free[1] else prior.prefill_quad_s,
            stream_s=float(coef[2]) if free[2] else prior.stream_s,
            kv_in_s=float(coef[3]) if free[3] else prior.kv_in_s)
        self._model = (prior, model)
        return model

    def _refit(self) -> None:
        self._since_fit = 0
        if len(self._samples) < self._min:
            return
        self._fit_at = self._clock()
        data = np.array(self._samples)
        shape = self._shape
        tokens = data[:, 0]
        x = np.column_stack([np.ones(len(data)), shape[0] * tokens + shape[1] * tokens * tokens,
                             data[:, 1], data[:, 2]])
        y = data[:, 3]
        spans = np.column_stack([tokens, data[:, 1], data[:, 2]])
        free = self._seen(spans)
        cols = [i for i in range(4) if free[i]]
        w = recency_weights(len(y), self._half_life)
        coef = np.zeros(4)
        sub = nonneg_lstsq(x[:, cols] * w[:, None], y * w)
        predicted = x[:, cols] @ sub
        resid = np.abs(predicted - y)
        # Off by 3 median residuals *and* by half its own prediction: a 60 ms step that took
        # 2 s is dropped; a 4.3 s prefill step that took 4.6 s is not (judged by the decode
        # steps' millisecond residuals alone, every prefill step was an outlier, and the
        # prefill term fell to 0: 73 ms predicted for a 1,023-token chunk, SmolLM2 goodput).
        keep = resid <= np.maximum(3.0 * max(float(np.median(resid)), 1e-4),
                                   0.5 * np.abs(predicted))
        if keep.sum() >= self._min and not keep.all():
            free = self._seen(spans[keep])
            cols = [i for i in range(4) if free[i]]
            sub = nonneg_lstsq(x[keep][:, cols] * w[keep][:, None], y[keep] * w[keep])
        coef[cols] = sub
        self._fitted = (coef, free, shape)
        self._model = None

    def _seen(self, inputs: np.ndarray) -> tuple[bool, ...]:
        """Which terms (fixed, prefill, streams, KV) the samples' ``inputs`` (prefill tokens,
        streams, KV tokens) can tell apart."""
        spanned = [bool(np.ptp(inputs[:, i]) >= self.MIN_SPAN[i]) for i in range(3)]
        for i in (0, 2):  # the prefill and KV terms: only some steps carry them
            spanned[i] = spanned[i] and int(np.count_nonzero(inputs[:, i])) >= self.MIN_SEEN
        return (True, *spanned)
