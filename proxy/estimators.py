"""Live estimates that feed the routing decision, fitted from what the proxy observes.

- :class:`PrefillFit` — seconds to prefill n new tokens on one engine, least squares (relative
  error) over the recent (n, seconds) samples on ``[1, n, n^2]`` with non-negative coefficients.
- :class:`LinkFit` — hand-over seconds for n tokens of KV on one prefill->decode pair:
  ``fixed + n * slope``; ``bytes_per_s = kv_bytes_per_token / slope``.

Both weight recent samples more (a half-life in samples; links change fastest), so a link that
slows down is followed within a few hand-overs.
- :class:`TokenRatio` — prompt tokens per character (to size a prompt before tokenizing it).
- :class:`StepFit` — one decode engine's step time from the gaps between tokens the proxy relays
  (``fixed + prefill tokens + streams + KV pulled``, see ``transport.cost.StepModel``).

Estimators are plain objects fed by ``observe``; they read no clock. Until enough samples exist
they answer with the prior they were built with (start-up probes replace priors quickly).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

from transport.cost import LinkModel, PrefillModel, StepModel

M = TypeVar("M", PrefillModel, LinkModel)


def recency_weights(n: int, half_life: float) -> np.ndarray:
    """Weight 1 for the newest sample, halving every ``half_life`` samples back: a link or an
    engine whose speed changes is followed within a few requests."""
    age = np.arange(n - 1, -1, -1, dtype=float)
    return 0.5 ** (age / half_life)


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0, by dropping negative terms and refitting."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


class _WindowFit(Generic[M]):
    """The last ``window`` (tokens, seconds) samples and the model last fitted to them; the
    prior until ``min_samples`` samples of at least two sizes exist."""

    def __init__(self, prior: M, window: int, min_samples: int, half_life: float):
        self._model: M = prior
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._min_samples = min_samples
        self._half_life = half_life
        self.last_observed_index = 0  # bumps on every sample (the re-probe loop watches it)

    @property
    def n_samples(self) -> int:
        return len(self._samples)

    def model(self) -> M:
        return self._model

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens <= 0 or seconds <= 0:
            return
        self._samples.append((n_tokens, seconds))
        self.last_observed_index += 1
        if len(self._samples) >= self._min_samples and len({s[0] for s in self._samples}) >= 2:
            ns = np.array([s[0] for s in self._samples], dtype=float)
            ys = np.array([s[1] for s in self._samples])
            self._model = self._fit(ns, ys, recency_weights(len(ys), self._half_life))

    def _fit(self, ns: np.ndarray, ys: np.ndarray, recency: np.ndarray) -> M:
        raise NotImplementedError


class PrefillFit(_WindowFit[PrefillModel]):
    def __init__(self, prior: PrefillModel, window: int = 64, min_samples: int = 3,
                 half_life: float = 16.0):
        super().__init__(prior, window, min_samples, half_life)

    def _fit(self, ns: np.ndarray, ys: np.ndarray, recency: np.ndarray) -> PrefillModel:
        # Scale columns so the quadratic term does not swamp the solve.
        scale = np.array([1.0, 1e-3, 1e-6])
        x = np.stack([np.ones_like(ns), ns * scale[1], ns * ns * scale[2]], axis=1)
        # Relative errors matter (a 10 ms miss is large for a short prompt, small for a long
        # one): weight each row by 1/y.
        w = recency / ys
        c = nonneg_lstsq(x * w[:, None], ys * w) * scale
        per_token = c[1]
        if per_token <= 0:  # all growth explained by the quadratic term: keep a tiny linear term
            per_token = max(1e-7, float(np.mean(ys / ns)) * 1e-3)
        return PrefillModel(fixed_s=float(c[0]), tokens_per_s=1.0 / per_token,
                            quad_s=float(c[2]))


class LinkFit(_WindowFit[LinkModel]):
    """Also detects a link that changed speed: when ``CHANGE_RUN`` hand-overs in a row take
    more than ``CHANGE_FACTOR`` x (or less than 1/``CHANGE_FACTOR`` x) the prediction, the
    older samples describe another link and are dropped; until enough new samples exist to
    fit both terms, the bandwidth is rescaled from the newest sample."""

    CHANGE_FACTOR = 2.0
    CHANGE_RUN = 2
    #: Hand-overs of fewer tokens are all fixed cost (the decode request, its first step):
    #: they say nothing of the bandwidth, and one of them once rescaled a link to 350 KB/s
    #: (3 tokens in 50 ms), which then priced a 1,300-token hand-over at 16 s.
    MIN_TOKENS = 64

    def __init__(self, prior: LinkModel, kv_bytes_per_token: int, window: int = 32,
                 min_samples: int = 3, half_life: float = 4.0):
        super().__init__(prior, window, min_samples, half_life)
        self._kvb = kv_bytes_per_token
        self._run = 0  # consecutive surprises in the same direction (sign = direction)

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens < self.MIN_TOKENS or seconds <= 0:
            return
        changed = False
        if self.n_samples >= self._min_samples:
            ratio = seconds / max(self._model.seconds(n_tokens, self._kvb), 1e-9)
            side = 1 if ratio > self.CHANGE_FACTOR else -1 if ratio < 1 / self.CHANGE_FACTOR else 0
            self._run = self._run + side if side and self._run * side >= 0 else side
            if abs(self._run) >= self.CHANGE_RUN:
                recent = list(self._samples)[-(self.CHANGE_RUN - 1):]
                self._samples.clear()
                self._samples.extend(recent)
                self._run = 0
                changed = True
        super().observe(n_tokens, seconds)
        if changed and self.n_samples < self._min_samples:
            if len({x[0] for x in self._samples}) >= 2:  # two sizes at the new speed: both
                ns = np.array([x[0] for x in self._samples], dtype=float)  # terms are known
                ys = np.array([x[1] for x in self._samples])
                self._model = self._fit(ns, ys, np.ones_like(ys))
            else:  # one size: keep the fixed cost (at most half of it), rescale bandwidth
                fixed = min(self._model.fixed_s, 0.5 * seconds)
                self._model = LinkModel(fixed_s=fixed, bytes_per_s=n_tokens * self._kvb / (
                    seconds - fixed))

    def _fit(self, ns: np.ndarray, ys: np.ndarray, recency: np.ndarray) -> LinkModel:
        x = np.stack([np.ones_like(ns), ns * 1e-3], axis=1)
        fixed, slope = nonneg_lstsq(x * recency[:, None], ys * recency) * np.array([1.0, 1e-3])
        return LinkModel(fixed_s=float(fixed), bytes_per_s=self._kvb / max(slope, 1e-12))


class TokenRatio:
    """Exponentially weighted tokens-per-character of observed prompts."""

    def __init__(self, prior: float = 0.25, weight: float = 0.1):
        self.value = prior
        self._weight = weight

    def observe(self, chars: int, tokens: int) -> None:
        if chars > 0 and tokens > 0:
            self.value += self._weight * (tokens / chars - self.value)

    def tokens(self, chars: int) -> int:
        return int(round(chars * self.value))


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
        if seconds <= 0:
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
