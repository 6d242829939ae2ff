"""Where a request goes: its engines and its route, decided once from what is known when it
arrives. No I/O, and the caller reads the clock: the prompt was measured before
(``proxy/tokenizer_pool.py``).

``make_plan`` picks the decode engine with the least outstanding work after this request (its
prompt tokens that engine has not cached, plus its output budget), then the prefill engine the
same way among the others (prompt tokens only), and asks the policy for the route of that
pair, telling it how many streams decode on that engine (or are about to: ``streams_exposed``)
and on the prefill engine where it decodes too, which requests bound there are still
prefilled elsewhere and when each is due to start decoding (``Ledger.exposure``), and the
request's latency targets. Where engines serve both roles and the request has targets, the
policy is asked about each engine as the decode engine, and ``proxy/pair_choice.py`` picks
the pair.
A prefill engine whose KV the decode engine has been failing to pull is not picked for it
(``proxy/pair_health.py``); with none left, the request goes local (reason ``kv_pulls_failing``).
The pool remembers the picks (ties rotate), so picking is the one side effect.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from proxy.costs import RouteCosts
from proxy.errors import NoEngineAvailable
from proxy.pair_choice import PairOption, best_pair
from proxy.policy import Decision, PolicyMode, RouteInputs, Targets, decide
from proxy.pool import Engine, EnginePool
from proxy.requests import ApiRequest, is_batch
from proxy.tokens import PromptTokens


@dataclass(frozen=True)
class Plan:
    decision: Decision
    prefill: Engine | None
    decode: Engine
    prompt_chars: int
    #: Exact when the prompt was measured, else estimated from its characters.
    prompt_tokens: int
    decode_cached_tokens: int
    output_budget: int
    #: The request's latency targets (its own, else the deployment's).
    targets: Targets | None = None

    @property
    def decode_new_tokens(self) -> int:
        """Prompt tokens the decode engine must load or compute (not in its own cache)."""
        return max(0, self.prompt_tokens - self.decode_cached_tokens)


def make_plan(req: ApiRequest, *, pool: EnginePool, costs: RouteCosts, policy: PolicyMode,
              prompt_chars: int, measured: PromptTokens | None, output_budget: int,
              load: Callable[[Engine], float], prefill: Engine | None = None,
              decode: Engine | None = None, targets: Targets | None = None,
              now: float = 0.0) -> Plan:
    """``prefill``/``decode`` pin the engines (start-up probes); ``load`` is an engine's
    outstanding work in tokens (``RouteCosts.load_tokens`` with its foreign requests); ``now``
    the monotonic clock's reading (when the requests bound there are due to start decoding)."""
    tokens = measured.n_tokens if measured else costs.token_ratio.tokens(prompt_chars)
    hits: dict[str, int] = {}

    def cached(engine: Engine) -> int:  # once per engine: picking and deciding both ask
        if engine.name not in hits:
            bs = engine.index.block_size
            hit = engine.index.cached_keys(measured.keys(bs)) if measured else 0
            # vLLM computes a prompt's last token whatever it holds: a whole prompt cached in
            # whole blocks has its last block computed again.
            hits[engine.name] = min(hit, (tokens - 1) // bs * bs) if hit and bs else hit
        return hits[engine.name]

    def decode_work(e: Engine) -> float:
        return load(e) + tokens - cached(e) + output_budget

    def prefill_work(e: Engine) -> float:
        return load(e) + tokens - cached(e)

    def decided(decode: Engine, prefill: Engine | None) -> Decision:
        decision = decide(policy, route_inputs(costs, decode, prefill, tokens, cached, targets,
                                               now))
        if decision.reason == "prefill_unavailable" and any(
                e is not decode for e in pool.usable("prefill")):
            # Prefill engines are up, but decode has been failing to pull their KV.
            decision = replace(decision, reason="kv_pulls_failing")
        return decision

    if decode is None and prefill is None and _picks_pairs(pool, policy, targets):
        usable = pool.usable("decode")
        usable = [d for d in usable if not d.silent] or usable  # (as ``pick_decode``)
        warm = [d for d in usable if not d.warming] or usable
        options = [PairOption(d, p, decided(d, p), streams_exposed(costs, d), decode_work(d))
                   for d in warm for p in [pool.cheapest_prefill(prefill_work, exclude=d)]]
        if not options:
            raise NoEngineAvailable("no decode engine is available")
        best = best_pair(options)
        decode, prefill = best.decode, pool.picked(best.prefill, "prefill")
        pool.picked(decode, "decode")
        decision = best.decision
    else:
        decode = decode or pool.pick_decode(decode_work)
        if decode is None:
            raise NoEngineAvailable("no decode engine is available")
        prefill = prefill or pool.pick_prefill(prefill_work, exclude=decode)
        decision = decided(decode, prefill)
    if req.force_route is not None and (req.force_route == "local" or prefill is not None):
        decision = replace(decision, route=req.force_route, reason="forced")
    if is_batch(req.body):  # (one hand-off for several prompts: see ``is_batch``)
        decision = replace(decision, route="local", reason="prompt_batch")
    return Plan(decision, prefill, decode, prompt_chars, tokens, cached(decode), output_budget,
                targets)


def _picks_pairs(pool: EnginePool, policy: PolicyMode, targets: Targets | None) -> bool:
    """With targets, ``auto`` weighs each pair where engines serve both roles."""
    return (policy.kind == "auto" and targets is not None and targets.any
            and any(e.can("prefill") for e in pool.decode))


def route_inputs(costs: RouteCosts, decode: Engine, prefill: Engine | None, tokens: int,
                 cached: Callable[[Engine], int], targets: Targets | None, now: float
                 ) -> RouteInputs:
    """What the policy is told about routing ``tokens`` prompt tokens to this pair."""
    inputs = costs.inputs(
        prefill.name if prefill else None, decode.name,
        prefill.foreign_requests if prefill else 0, decode.foreign_requests,
        prefill.mean_prompt_tokens if prefill else None, prompt_tokens=tokens,
    )
    gap_target = targets is not None and targets.itl_s is not None
    room, arriving = costs.ledger.exposure(decode.name, now)
    streams = streams_exposed(costs, decode, len(arriving))
    if not gap_target or decode.foreign_requests:
        # No gap target: no budget to spend. Other clients' streams there: their gaps are not
        # known to tolerate any stall.
        room, arriving = 0, tuple(replace(a, room=0) for a in arriving)
    prefill_streams = streams_beside_prefill(costs, prefill, now) if prefill else 0
    if prefill is not None and prefill_streams:
        inputs = replace(inputs, prefill_step=costs.step_model(prefill.name))
    return RouteInputs(
        prompt_tokens=tokens, prefill_cached_tokens=cached(prefill) if prefill else 0,
        decode_cached_tokens=cached(decode), prefill_available=prefill is not None,
        costs=inputs, streams=streams, targets=targets, stall_room=room, arriving=arriving,
        prefill_streams=prefill_streams)


def streams_exposed(costs: RouteCosts, decode: Engine, arriving: int = 0) -> int:
    """The streams decoding on ``decode`` now or about to: the ones relayed from there, and
    this proxy's requests bound there but for the ``arriving`` ones still prefilled elsewhere
    (those the policy counts by when they start: ``proxy.policy.exposure``). Counting only the
    ones already streaming let a long local prefill start on an engine whose next stream was a
    moment away (a 1.2 s stall at 0.44 req/s, SmolLM2 prefill-heavy). Other clients' requests
    there count as streams too. Not this proxy's whole replies, nor its prefill legs there: no
    client sees their gaps."""
    own = max(costs.tracker(decode.name).streams, costs.ledger.bound(decode.name) - arriving)
    return own + decode.foreign_requests


def streams_beside_prefill(costs: RouteCosts, prefill: Engine, now: float) -> int:
    """The streams decoding on ``prefill`` (an engine of the one pool, serving both roles):
    what a prompt prefilled there stalls. Other clients' requests there count as streams
    where the engine decodes; on a prefill engine they are prompts."""
    own = max(costs.tracker(prefill.name).streams, costs.ledger.decoding(prefill.name, now))
    return own + (prefill.foreign_requests if prefill.can("decode") else 0)


def estimate_header(plan: Plan) -> str | None:
    """Each route's predicted TTFT and, with streams decoding beside, the gap it puts in them
    and the stalls over their target they could still take. Routes that exist only: without a
    prefill engine the disaggregated figures would be priors alone."""
    d = plan.decision
    if d.predicted_disaggregated_s is None or d.predicted_local_s is None:
        return None
    both = plan.prefill is not None
    parts = ([f"disaggregated={d.predicted_disaggregated_s * 1e3:.1f}ms"] if both else []) + [
        f"local={d.predicted_local_s * 1e3:.1f}ms"]
    if d.gap_disaggregated_s is not None and d.gap_local_s is not None:
        parts += ([f"gap_disaggregated={d.gap_disaggregated_s * 1e3:.1f}ms"] if both else []) + [
            f"gap_local={d.gap_local_s * 1e3:.1f}ms", f"stall_room={d.stall_room}"]
    if d.gap_prefill_s is not None and both:  # the prefill engine's own streams (one pool)
        parts.append(f"gap_prefill_engine={d.gap_prefill_s * 1e3:.1f}ms")
    return "; ".join(parts)
