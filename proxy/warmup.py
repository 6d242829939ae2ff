"""Pay each prefill->decode pair's NIXL handshake at start-up, not in a user's first request."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from proxy.pool import Engine, EnginePool
from transport import kv_params

log = logging.getLogger(__name__)

# Long enough to fill several KV blocks, so the warm-up really moves KV over NIXL.
_PROBE_WORDS = ("alpha", "river", "stone", "orbit", "maple", "signal", "harbor", "ember",
                "canyon", "falcon", "glacier", "mosaic", "lagoon", "cobalt", "tundra", "beacon")
_WARMUP_PROMPT = " ".join(["warm up the prefill to decode path"] * 24)


#: The most the start-up warm-up (handshakes, then the cost model's probes) may hold the proxy
#: not ready; past it what is left is skipped: users' first requests pay those handshakes, and
#: the cost model starts from its priors.
START_DEADLINE_S = 300.0


async def warm_up_at_start(orchestrator, model: str, probe_tokens: tuple[int, ...], *,
                           timeout_s: float = START_DEADLINE_S) -> bool:
    """:func:`warm_up_pairs`, then :func:`probe_routes`, within ``timeout_s`` overall; True
    when every handshake succeeded in time."""
    try:
        async with asyncio.timeout(timeout_s):
            ok = await warm_up_pairs(orchestrator.pool, model)
            await probe_routes(orchestrator, model, probe_tokens)
            return ok
    except TimeoutError:
        log.warning("start-up warm-up not over within %.0fs: the rest is skipped", timeout_s)
        return False


async def warm_up_pairs(pool: EnginePool, model: str, *, timeout_s: float = 120.0) -> bool:
    """Run one P/D completion per pair of open engines (``Engine.open``: up, neither draining
    nor cordoned), once a decode engine is up (waited for up to ``timeout_s``); True when all
    succeeded. Each pair is judged when its turn comes (an engine may go down meanwhile); a
    pair with an engine being warmed on its own (it came up meanwhile: :func:`warm_up_engine`)
    is left to that warm-up."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pool.ready:
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.2)
    ok = True
    for p, d in pool.pairs():
        if p.open and d.open and not (p.warming or d.warming):
            ok &= await _warm_pair(p.client, d.client, model)
    log.info("warm-up %s", "done" if ok else "failed")
    return ok


async def warm_up_engine(pool: EnginePool, engine: Engine, model: str) -> bool:
    """Pay a (re)joined engine's handshakes with every open engine (``Engine.open``) of the
    other role, while it is marked ``warming`` (routing prefers the others meanwhile); True when
    all succeeded. An engine draining or cordoned itself is sent nothing.

    One at a time per engine: an engine that came up again while its last warm-up ran (it
    flapped) has that one cancelled (its handshakes may have met the engine down) and pays them
    all in this one, which alone clears ``warming``."""
    if not engine.open:  # draining or cordoned (and come back up): nothing new, nor this
        return True
    me = asyncio.current_task()
    previous, engine.warm_up = engine.warm_up, me
    engine.warming = True
    t0 = time.perf_counter()
    try:
        if previous is not None and not previous.done():
            previous.cancel()
            await asyncio.wait([previous])
        pairs = [(p, d) for p, d in pool.pairs() if engine in (p, d)
                 and (p if d is engine else d).open]
        ok = True
        for p, d in pairs:
            ok &= await _warm_pair(p.client, d.client, model)
        log.info("warm-up of %s with %d engine(s) %s in %.2fs", engine.name, len(pairs),
                 "done" if ok else "failed", time.perf_counter() - t0)
        return ok
    except asyncio.CancelledError:
        # Replaced by a newer warm-up (and only that: not the proxy stopping too) ends here.
        if engine.warm_up is me or me is None or me.uncancel() > 0:
            raise
        return False
    finally:
        if engine.warm_up is me:
            engine.warming = False
            engine.warm_up = None


async def _warm_pair(prefill, decode, model: str) -> bool:
    body = {"model": model, "prompt": _WARMUP_PROMPT, "max_tokens": 2, "temperature": 0}
    pbody = dict(body, max_tokens=1, return_token_ids=True)
    pbody[kv_params.BODY_KEY] = kv_params.prefill_request_params()
    headers = {"x-request-id": "pdserve-warmup"}
    try:
        reply = await prefill.post_json("/v1/completions", pbody, headers, 120.0)
        handoff = kv_params.parse_prefill_json(reply.body)
        dbody = dict(body)
        dbody[kv_params.BODY_KEY] = kv_params.decode_request_params(handoff)
        reply = await decode.post_json("/v1/completions", dbody, headers, 120.0)
        return reply.status == 200
    except Exception as exc:  # warm-up failure is logged, the proxy still serves
        log.warning("warm-up %s -> %s failed: %s", prefill.name, decode.name, exc)
        return False


async def reprobe_links(orchestrator, model: str, probe_tokens: tuple[int, ...],
                        interval_s: float) -> None:
    """Keep every pair's link estimate fresh: when a pair measured no hand-over for
    ``interval_s`` (because the policy routed everything local, say), send one disaggregated
    probe through it. Without this a link that recovered would never be tried again.

    Probes alternate between the given sizes: a link's fixed cost and bandwidth can only be
    told apart from hand-overs of different sizes at the same link speed."""
    pool, costs = orchestrator.pool, orchestrator.costs
    seen: dict[tuple[str, str], int] = {}
    sent: dict[tuple[str, str], int] = {}
    while True:
        await asyncio.sleep(interval_s)
        for p, d in pool.pairs():
            key = (p.name, d.name)
            count = costs.link_samples(*key)
            if p.open and d.open and seen.get(key) == count:  # (nothing new: no probe)
                n = probe_tokens[sent.get(key, 0) % len(probe_tokens)]
                sent[key] = sent.get(key, 0) + 1
                await _probe(orchestrator, model, n, "disaggregated", prefill=p, decode=d)
            seen[key] = costs.link_samples(*key)


def reprobe_sizes(probe_tokens: tuple[int, ...]) -> tuple[int, ...]:
    """The smallest and the middle start-up probe: cheap, and two sizes apart."""
    ordered = sorted(set(probe_tokens))
    return tuple(dict.fromkeys((ordered[0], ordered[len(ordered) // 2])))


async def _probe(orchestrator, model: str, n: int, route: str, prefill=None, decode=None
                 ) -> None:
    from proxy.requests import ApiRequest

    body = {"model": model, "prompt": await probe_prompt(n, orchestrator.prompts),
            "max_tokens": 1, "temperature": 0, "stream": True}
    req = ApiRequest("completions", body, True, f"pdserve-probe-{route}-{n}",
                     force_route=route)  # type: ignore[arg-type]
    try:
        result = await orchestrator.serve(req, prefill=prefill, decode=decode)
        async for _ in result.chunks:
            pass
    except Exception as exc:  # a failed probe leaves the estimates as they were
        log.warning("probe %s/%d failed: %s", route, n, exc)


async def probe_prompt(n_tokens: int, prompts) -> str | list[int]:
    """A fresh random prompt of about ``n_tokens`` tokens (exactly, as token ids, when the
    proxy has the tokenizer); random so that no engine has it cached."""
    rng = random.Random()
    words = " ".join(rng.choice(_PROBE_WORDS) for _ in range(n_tokens))
    if prompts is not None:
        ids = await prompts.ids({"prompt": words})
        if ids:
            return ids[:n_tokens]
    return words[: 4 * n_tokens]  # ~4 characters per token


async def probe_routes(orchestrator, model: str, probe_tokens: tuple[int, ...]) -> None:
    """Seed the cost model: each probe length once per route, streamed, on the real engines.

    Probes go through the orchestrator like user requests (so they measure exactly what users
    see) with the route forced. Prompts are random so no engine has them cached.
    """
    pool = orchestrator.pool
    for _ in range(2):  # twice: the first round still pays one-off warm-up costs
        for n in probe_tokens:
            # Pairs of open engines only, judged at their turn: a probe through an engine that
            # is down (hung, say) would wait out the prefill deadline, the proxy not ready.
            for p, d in pool.pairs():
                for route in ("local", "disaggregated"):
                    if p.open and d.open:
                        await _probe(orchestrator, model, n, route, prefill=p, decode=d)
            if not pool.pairs():  # no prefill-capable engine: local only
                for d in pool.decode:
                    if d.open:
                        await _probe(orchestrator, model, n, "local", decode=d)
