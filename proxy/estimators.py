"""Live estimates that feed the routing decision, fitted from what the proxy observes.

- :class:`PrefillFit` — seconds to prefill n new tokens on one engine, least squares (relative
  error) over the recent (n, seconds) samples on ``[1, n, n^2]`` with non-negative coefficients.
- :class:`LinkFit` — hand-over seconds for n tokens of KV on one prefill->decode pair:
  ``fixed + n * slope``; ``bytes_per_s = kv_bytes_per_token / slope``.

Both weight recent samples more (a half-life in samples; links change fastest), so a link that
slows down is followed within a few hand-overs.
- :class:`TokenRatio` — prompt tokens per character (to size a prompt before tokenizing it).
- ``proxy/step_fit.py`` — one decode engine's step time from the gaps between tokens the proxy
  relays (``fixed + prefill tokens + streams + KV pulled``, see ``transport.cost.StepModel``).

Estimators are plain objects fed by ``observe``; they read no clock. Until enough samples exist
they answer with the prior they were built with (start-up probes replace priors quickly).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from typing import Generic, TypeVar

import numpy as np

from transport.cost import LinkModel, PrefillModel

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
    prior until ``min_samples`` samples of at least two sizes exist. Every term is fitted once
    the sizes span ``MIN_SPAN`` (the largest that many times the smallest); sizes closer than
    that keep the model's per-token terms and refit its fixed cost only (hand-overs of 512 and
    520 tokens say nothing of the per-token cost: their noise gave a link a bandwidth of
    1e17 B/s, and a prefill fit 1/1000 of its per-token cost)."""

    MIN_SPAN = 2.0

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
        if n_tokens <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        self._samples.append((n_tokens, seconds))
        self.last_observed_index += 1
        if len(self._samples) >= self._min_samples and len({s[0] for s in self._samples}) >= 2:
            ns = np.array([s[0] for s in self._samples], dtype=float)
            ys = np.array([s[1] for s in self._samples])
            recency = recency_weights(len(ys), self._half_life)
            if ns.max() >= self.MIN_SPAN * ns.min():
                self._model = self._fit(ns, ys, recency)
            else:
                fixed = float(np.sum(recency * (ys - self._sized(ns))) / np.sum(recency))
                self._model = self._with_fixed(max(0.0, fixed))

    def _fit(self, ns: np.ndarray, ys: np.ndarray, recency: np.ndarray) -> M:
        raise NotImplementedError

    def _sized(self, ns: np.ndarray) -> np.ndarray:
        """The model's seconds for ``ns`` tokens beyond its fixed cost."""
        raise NotImplementedError

    def _with_fixed(self, fixed_s: float) -> M:
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

    def _sized(self, ns: np.ndarray) -> np.ndarray:
        m = self._model
        return ns / m.tokens_per_s + m.quad_s * ns * ns

    def _with_fixed(self, fixed_s: float) -> PrefillModel:
        return replace(self._model, fixed_s=fixed_s)


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
        if slope <= 0:  # no growth with size in this window: not an infinitely fast link
            return self._with_fixed(max(0.0, float(np.sum(recency * (ys - self._sized(ns)))
                                                   / np.sum(recency))))
        return LinkModel(fixed_s=float(fixed), bytes_per_s=self._kvb / slope)

    def _sized(self, ns: np.ndarray) -> np.ndarray:
        return ns * self._kvb / self._model.bytes_per_s

    def _with_fixed(self, fixed_s: float) -> LinkModel:
        return replace(self._model, fixed_s=fixed_s)


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
