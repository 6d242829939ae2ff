"""The proxy's live cost state: one prefill fit per engine (remote and local prefill), one link
fit per prefill->decode pair, queued prompt work per engine, and the tokens-per-char ratio.

Call order per request: ``inputs()`` (snapshot for the pure decision) → ``begin_*`` when work is
dispatched → ``end_*`` in a ``finally`` → ``observe_*`` with what was measured. Only samples taken
while the engine had no other prompt work in flight are used to fit (queueing would bias them);
queueing itself is predicted from the queued tokens.
"""

from __future__ import annotations

from collections import defaultdict

from proxy.estimators import LinkFit, PrefillFit, TokenRatio
from proxy.policy import CostInputs
from transport.cost import LinkModel, PrefillModel

#: Priors until start-up probes and traffic replace them (CPU-class engine, loopback link).
PREFILL_PRIOR = PrefillModel(fixed_s=0.02, tokens_per_s=2000.0)
LINK_PRIOR = LinkModel(fixed_s=0.03, bytes_per_s=100e6)


class RouteCosts:
    def __init__(self, kv_bytes_per_token: int):
        self.kv_bytes_per_token = kv_bytes_per_token
        self.token_ratio = TokenRatio()
        self._remote: dict[str, PrefillFit] = defaultdict(lambda: PrefillFit(PREFILL_PRIOR))
        self._local: dict[str, PrefillFit] = defaultdict(lambda: PrefillFit(PREFILL_PRIOR))
        self._links: dict[tuple[str, str], LinkFit] = defaultdict(
            lambda: LinkFit(LINK_PRIOR, kv_bytes_per_token)
        )
        self._queued_tokens: dict[str, int] = defaultdict(int)
        self._output_tokens: dict[str, int] = defaultdict(int)
        #: EWMA of prompt sizes seen (tokens): the size assumed for requests of unknown size.
        self.typical_prompt_tokens = 512

    # -- snapshot for the decision -------------------------------------------------------------
    def inputs(self, prefill: str | None, decode: str, prefill_foreign_requests: int = 0,
               decode_foreign_requests: int = 0, prefill_mean_prompt_tokens: float | None = None,
               ) -> CostInputs:
        """Snapshot for one decision. ``*_foreign_requests``: requests the engine reports
        running or waiting beyond this proxy's own (other clients, other proxies); each is
        costed as a prompt of the engine's recent mean size (or the typical size seen here)."""
        local = self._local[decode].model()
        typical = self.typical_prompt_tokens
        decode_queue_s = local.seconds(self._queued_tokens[decode]) + (
            decode_foreign_requests * local.seconds(typical)
        )
        foreign_size = int(prefill_mean_prompt_tokens or typical)
        if prefill is None:
            return CostInputs(self.kv_bytes_per_token, PREFILL_PRIOR, local, LINK_PRIOR,
                              decode_queue_s=decode_queue_s)
        remote = self._remote[prefill].model()
        return CostInputs(
            kv_bytes_per_token=self.kv_bytes_per_token,
            remote_prefill=remote,
            local_prefill=local,
            link=self._links[(prefill, decode)].model(),
            prefill_queue_s=remote.seconds(self._queued_tokens[prefill])
            + prefill_foreign_requests * remote.seconds(foreign_size),
            decode_queue_s=decode_queue_s,
        )

    def link_samples(self, prefill: str, decode: str) -> int:
        """How many hand-overs this pair has measured so far (grows with every one)."""
        return self._links[(prefill, decode)].last_observed_index

    # -- queued work ---------------------------------------------------------------------------
    def queued_tokens(self, engine: str) -> int:
        return self._queued_tokens[engine]

    def begin(self, engine: str, tokens: int) -> bool:
        """Count ``tokens`` of prompt work on ``engine``; True when it had none queued before."""
        idle = self._queued_tokens[engine] == 0
        self._queued_tokens[engine] += tokens
        return idle

    def end(self, engine: str, tokens: int) -> None:
        self._queued_tokens[engine] = max(0, self._queued_tokens[engine] - tokens)

    def begin_output(self, engine: str, tokens: int) -> None:
        """Count the output budget (tokens still to generate) of a request decoding on
        ``engine``: routing load only, it does not delay another request's first token."""
        self._output_tokens[engine] += tokens

    def end_output(self, engine: str, tokens: int) -> None:
        self._output_tokens[engine] = max(0, self._output_tokens[engine] - tokens)

    def load_tokens(self, engine: str, foreign_requests: int = 0,
                    mean_prompt_tokens: float | None = None) -> float:
        """Outstanding work on ``engine`` in tokens, what routing minimises: this proxy's
        queued prompt tokens and the output budget of its requests still decoding there (both
        exact and current), plus the requests other clients have running or waiting on it
        (queue depth from the engine's metrics), each at the engine's recent mean prompt size."""
        size = mean_prompt_tokens or self.typical_prompt_tokens
        return (self._queued_tokens[engine] + self._output_tokens[engine]
                + foreign_requests * size)

    # -- measurements --------------------------------------------------------------------------
    def observe_remote_prefill(self, engine: str, new_tokens: int, seconds: float) -> None:
        self._remote[engine].observe(new_tokens, seconds)

    def observe_local_prefill(self, engine: str, new_tokens: int, seconds: float) -> None:
        self._local[engine].observe(new_tokens, seconds)

    def observe_handover(self, prefill: str, decode: str, tokens: int, seconds: float) -> None:
        self._links[(prefill, decode)].observe(tokens, seconds)

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
            "queued_tokens": dict(self._queued_tokens),
            "output_tokens": dict(self._output_tokens),
        }
