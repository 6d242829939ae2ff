"""The proxy's live cost state: one prefill fit per engine (remote and local prefill), one link
fit per prefill->decode pair, the tokens-per-char ratio, each engine's step model
(``proxy/step_fit.py``, ``proxy/worst_gap.py``) and each route's TTFT correction factor
(``proxy/ttft_correction.py``: measured over predicted, per engine or pair, prompt size class and
queued or not); the work queued on each engine is the ledger's (``proxy/ledger.py``), read here.

Call order per request: ``inputs()`` (snapshot for the pure decision) → work is claimed in the
ledger → ``observe_*`` with what was measured. Only samples taken while the engine had no other
prompt work in flight are used to fit (queueing would bias them); queueing itself is predicted
from the queued prompts, less what the oldest has been computed so far (``queue_s``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING

from proxy.estimators import LinkFit, PrefillFit, TokenRatio
from proxy.ledger import Ledger
from proxy.policy import CostInputs
from proxy.step_fit import StepFit
from proxy.step_tracker import Arrival, StepTracker
from proxy.ttft_correction import TtftCorrection, size_class
from proxy.worst_gap import WorstGapFit
from transport.cost import LinkModel, PrefillModel, StepModel

if TYPE_CHECKING:
    from proxy.engine import Engine

#: Priors until start-up probes and traffic replace them (CPU-class engine, loopback link).
PREFILL_PRIOR = PrefillModel(fixed_s=0.02, tokens_per_s=2000.0)
LINK_PRIOR = LinkModel(fixed_s=0.03, bytes_per_s=100e6)
#: A decode step until an engine's own are measured: a few ms, plus its prompt chunk at the
#: engine's fitted local prefill cost (filled in from that fit, ``step_model``).
STEP_FIXED_PRIOR_S = 0.005
STEP_STREAM_PRIOR_S = 0.0005
#: The least time between two refits of an engine's step model once it is past its first
#: samples (``StepFit``): real engines give 30-200 gaps a second, so every 32 of them is 0.2-1 s.
STEP_REFIT_INTERVAL_S = 0.5
ROUTES = ("disaggregated", "local")


class RouteCosts:
    def __init__(self, kv_bytes_per_token: int, ledger: Ledger | None = None,
                 chunk_tokens: int = 2048, on_arrival: Arrival | None = None):
        self.kv_bytes_per_token = kv_bytes_per_token
        self.ledger = ledger or Ledger()
        #: The decode engines' prefill chunk (vLLM's max_num_batched_tokens there).
        self.chunk_tokens = chunk_tokens
        self._steps: dict[str, StepFit] = defaultdict(
            lambda: StepFit(refit_interval_s=STEP_REFIT_INTERVAL_S))
        self._trackers: dict[str, StepTracker] = {}
        #: Each (decode engine, route)'s worst gap beside the streams there.
        self._worst: dict[tuple[str, str], WorstGapFit] = defaultdict(WorstGapFit)
        #: Each engine's step model with its worst-gap fits, and what it was made from.
        self._worst_models: dict[str, tuple[StepModel, tuple, StepModel]] = {}
        #: Each engine's step prior and the local prefill model it was made from.
        self._step_priors: dict[str, tuple[PrefillModel, StepModel]] = {}
        self._on_arrival = on_arrival
        self.token_ratio = TokenRatio()
        self._remote: dict[str, PrefillFit] = defaultdict(lambda: PrefillFit(PREFILL_PRIOR))
        self._local: dict[str, PrefillFit] = defaultdict(lambda: PrefillFit(PREFILL_PRIOR))
        self._links: dict[tuple[str, str], LinkFit] = defaultdict(
            lambda: LinkFit(LINK_PRIOR, kv_bytes_per_token)
        )
        #: Each (engine or pair, route, prompt size class, queued)'s TTFT correction factor.
        self._ttft: dict[tuple[str | None, str, str, int, bool], TtftCorrection] = (
            defaultdict(TtftCorrection))
        #: EWMA of prompt sizes seen (tokens): the size assumed for requests of unknown size.
        self.typical_prompt_tokens = 512

    # -- snapshot for the decision -------------------------------------------------------------
    def inputs(self, prefill: str | None, decode: str, prefill_foreign_requests: int = 0,
               decode_foreign_requests: int = 0, prefill_mean_prompt_tokens: float | None = None,
               prompt_tokens: int | None = None) -> CostInputs:
        """Snapshot for one decision. ``*_foreign_requests``: requests the engine reports
        running or waiting beyond this proxy's own (other clients, other proxies); each is
        costed as a prompt of the engine's recent mean size (or the typical size seen here).
        ``prompt_tokens``: the request's size, for its routes' TTFT corrections (none without)."""
        local = self._local[decode].model()
        step = self.step_model(decode)
        typical = self.typical_prompt_tokens
        decode_queue_s = self.queue_s(decode, local) + (
            decode_foreign_requests * local.seconds(typical)
        )
        foreign_size = int(prefill_mean_prompt_tokens or typical)
        remote = self._remote[prefill].model() if prefill is not None else PREFILL_PRIOR
        prefill_queue_s = 0.0 if prefill is None else self.queue_s(prefill, remote) + (
            prefill_foreign_requests * remote.seconds(foreign_size))
        # Behind queued prompt work or not: each route's factor for that case.
        queued = (prefill_queue_s > 0 or decode_queue_s > 0, decode_queue_s > 0)
        correction = (1.0, 1.0) if prompt_tokens is None else (
            self.ttft_correction("disaggregated", prefill, decode, prompt_tokens, queued[0]),
            self.ttft_correction("local", None, decode, prompt_tokens, queued[1]))
        return CostInputs(
            kv_bytes_per_token=self.kv_bytes_per_token,
            remote_prefill=remote,
            local_prefill=local,
            link=self._links[(prefill, decode)].model() if prefill is not None else LINK_PRIOR,
            prefill_queue_s=prefill_queue_s,
            decode_queue_s=decode_queue_s,
            decode_step=step,
            chunk_tokens=self.chunk_tokens,
            ttft_correction=correction,
            ttft_queued=queued,
        )

    def link_samples(self, prefill: str, decode: str) -> int:
        """How many hand-overs this pair has measured so far (grows with every one)."""
        return self._links[(prefill, decode)].last_observed_index

    # -- decode steps --------------------------------------------------------------------------
    def tracker(self, engine: str) -> StepTracker:
        """What ``engine``'s relayed streams say about its steps (created on first use)."""
        if engine not in self._trackers:
            self._trackers[engine] = StepTracker(
                self._steps[engine].observe, self._on_arrival,
                lambda route, tokens, streams, worst: self._observe_worst_gap(
                    engine, route, tokens, streams, worst))
        return self._trackers[engine]

    def step_model(self, engine: str) -> StepModel:
        """``engine``'s fitted step time. Its prefill term has the engine's local prefill model's
        shape (linear and quadratic terms; the fixed part of a TTFT is the step's own); the
        steps seen scale it. Until a term is measured, the prior's. A chunk's per-token cost
        taken at the full chunk size and applied linearly priced a 64-token chunk at 6.0 ms a
        token against the 3.0 ms it takes (SmolLM2: 443 ms predicted, 250 ms measured). With
        the arrivals' worst gaps fitted (``proxy/worst_gap.py``), those too."""
        model = self._plain_step(engine)
        fits = (self._worst.get((engine, "disaggregated")), self._worst.get((engine, "local")))
        fitted = tuple(f.fitted if f is not None else None for f in fits)
        if fitted == (None, None):
            return model
        made = self._worst_models.get(engine)
        if made is None or made[0] is not model or any(
                a is not b for a, b in zip(made[1], fitted, strict=True)):
            kv, local = fitted
            made = self._worst_models[engine] = (model, fitted, replace(
                model, **({"handover_fixed_s": kv[0], "handover_s": kv[1]} if kv else {}),
                **({"local_fixed_s": local[0], "local_s": local[1]} if local else {})))
        return made[2]

    def _plain_step(self, engine: str) -> StepModel:
        local = self._local[engine].model()
        cached = self._step_priors.get(engine)
        if cached is None or cached[0] is not local:  # (the fit's model changes at a refit)
            cached = self._step_priors[engine] = (local, StepModel(
                fixed_s=STEP_FIXED_PRIOR_S, prefill_s=1.0 / local.tokens_per_s,
                prefill_quad_s=local.quad_s, stream_s=STEP_STREAM_PRIOR_S))
        return self._steps[engine].model(cached[1])

    def _observe_worst_gap(self, engine: str, route: str, tokens: int, streams: int,
                           worst_s: float) -> None:
        """An arrival's worst gap, as its excess over the plain step it was predicted by."""
        plain = self._plain_step(engine)
        base = (plain.seconds(0, streams) if route == "disaggregated"
                else plain.seconds(min(tokens, self.chunk_tokens), streams))
        self._worst[(engine, route)].observe(tokens, worst_s - base)

    # -- queued work (the ledger's) -------------------------------------------------------------
    def queued_tokens(self, engine: str) -> int:
        return self.ledger.load(engine).prompt_tokens

    def queue_s(self, engine: str, model: PrefillModel) -> float:
        """Seconds of this proxy's prompt work still to compute on ``engine``: each queued
        prompt at ``model``, less what the oldest has had (up to all of its own). Costing the
        sum whole, a prompt half computed counted in full: 64 tokens behind a 1,024-token one
        were predicted 4.4-5.8 s and took 1.6-4.5 s (SmolLM2 mixed)."""
        prompts, busy_s = self.ledger.queued_prompts(engine)
        if not prompts:
            return 0.0
        return sum(model.seconds(n) for n in prompts) - min(busy_s, model.seconds(prompts[0]))

    def load_tokens(self, engine: str, foreign_requests: int = 0,
                    mean_prompt_tokens: float | None = None) -> float:
        """Outstanding work on ``engine`` in tokens, what routing minimises: this proxy's
        queued prompt tokens and the output budget of its requests still decoding there (both
        exact and current), plus the requests other clients have running or waiting on it
        (queue depth from the engine's metrics), each at the engine's recent mean prompt size."""
        size = mean_prompt_tokens or self.typical_prompt_tokens
        load = self.ledger.load(engine)
        return load.prompt_tokens + load.output_tokens + foreign_requests * size

    def engine_load_tokens(self, engine: Engine) -> float:
        """:meth:`load_tokens` of ``engine``, with what its metrics say of other clients."""
        return self.load_tokens(engine.name, engine.foreign_requests, engine.mean_prompt_tokens)

    # -- measurements --------------------------------------------------------------------------
    def observe_remote_prefill(self, engine: str, new_tokens: int, seconds: float) -> None:
        self._remote[engine].observe(new_tokens, seconds)

    def observe_local_prefill(self, engine: str, new_tokens: int, seconds: float) -> None:
        self._local[engine].observe(new_tokens, seconds)

    def observe_handover(self, prefill: str, decode: str, tokens: int, seconds: float) -> None:
        self._links[(prefill, decode)].observe(tokens, seconds)

    def observe_ttft(self, route: str, prefill: str | None, decode: str, prompt_tokens: int,
                     measured_over_predicted: float, queued: bool = False) -> None:
        """A request routed ``route`` (to ``prefill`` -> ``decode``, or computed on ``decode``)
        took this many times its predicted TTFT (``queued``: predicted behind prompt work)."""
        self._ttft[_ttft_key(route, prefill, decode, prompt_tokens, queued)].observe(
            measured_over_predicted)

    def ttft_correction(self, route: str, prefill: str | None, decode: str,
                        prompt_tokens: int, queued: bool = False) -> float:
        """The factor on ``route``'s predicted TTFT for a prompt of that size there, behind
        queued prompt work or not."""
        c = self._ttft.get(_ttft_key(route, prefill, decode, prompt_tokens, queued))
        return 1.0 if c is None else c.factor

    def observe_prompt(self, chars: int, tokens: int) -> None:
        self.token_ratio.observe(chars, tokens)
        self.typical_prompt_tokens = int(0.9 * self.typical_prompt_tokens + 0.1 * tokens)

    def describe(self) -> dict[str, object]:
        """Current fits, for /debug/costs and benchmarks."""
        return {
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "tokens_per_char": self.token_ratio.value,
            "remote_prefill": {k: vars(v.model()) | {"samples": v.n_samples}
                               for k, v in self._remote.items()},
            "local_prefill": {k: vars(v.model()) | {"samples": v.n_samples}
                              for k, v in self._local.items()},
            "links": {f"{p}->{d}": vars(v.model()) | {"samples": v.n_samples}
                      for (p, d), v in self._links.items()},
            "decode_steps": {e: vars(self.step_model(e)) | {
                "samples": f.n_samples, "chunk_tokens": self.chunk_tokens,
                "worst_gap_samples": {r: self._worst[(e, r)].n_samples for r in ROUTES
                                      if (e, r) in self._worst}}
                for e, f in self._steps.items()},
            "ttft_correction": {
                f"{route}|{f'{p}->{d}' if p else d}|{1 << max(0, 2 * size - 1)}+"
                f"{'|queued' if queued else ''}": {
                    "factor": round(c.factor, 3), "samples": c.samples}
                for (p, d, route, size, queued), c in self._ttft.items()},
            "queued_tokens": {k: v.prompt_tokens for k, v in self.ledger.loads().items()},
            "output_tokens": {k: v.output_tokens for k, v in self.ledger.loads().items()},
        }


def _ttft_key(route: str, prefill: str | None, decode: str, prompt_tokens: int, queued: bool
              ) -> tuple[str | None, str, str, int, bool]:
    return (prefill if route == "disaggregated" else None, decode, route,
            size_class(prompt_tokens), queued)
