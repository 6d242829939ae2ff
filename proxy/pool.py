"""The set of prefill and decode engines the proxy routes across, with health and load.

Health is probed in the background and marked down at once on a failed call. ``pick_*`` return
the healthy, non-draining engine with the lowest cost, as the caller defines it (the orchestrator
passes outstanding tokens plus what this request would add, see ``RouteCosts.load_tokens``), or
None. Among equal costs, fewer of this proxy's requests in flight, then the one picked longest
ago (so requests that finish before the next arrives still spread over every engine).

Membership is fixed (dev mode: the urls in the config) or reconciled from a directory
(:meth:`EnginePool.reconcile`, Ray mode): new engines join unhealthy until probed, an engine
whose url changed (restarted elsewhere) is replaced, and a vanished one leaves. Draining engines
finish what they have but get nothing new (scale-down: ``proxy/scale_down.py``).

Roles and duties: ``proxy/engine.py``. :meth:`pairs` lists every pair that could hand KV over
(prefill-capable to decode-capable, never an engine to itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Sequence

from proxy import probes
from proxy.duties import assigned_duties
from proxy.engine import BOTH, Duty, EndpointInfo, Engine, Role
from proxy.engine_client import EngineClient, EngineTimeout, EngineUnreachable
from proxy.metrics import ProxyMetrics
from proxy.pair_health import Handover, PairHealth
from proxy.stalls import stalled
from transport.kv_events import AllCleared

__all__ = ["BOTH", "Duty", "EndpointInfo", "Engine", "EnginePool", "Role"]

log = logging.getLogger(__name__)


def _no_cost(engine: Engine) -> float:
    return 0.0


class EnginePool:
    def __init__(
        self,
        prefill: Sequence[EngineClient],
        decode: Sequence[EngineClient],
        metrics: ProxyMetrics,
        health_timeout_s: float = 2.0,
        prefill_events: Sequence[str] = (),
        decode_events: Sequence[str] = (),
        both: Sequence[EngineClient] = (),
        both_events: Sequence[str] = (),
        both_duties: frozenset[str] = BOTH,
    ):
        self.engines: list[Engine] = []
        for role, clients, endpoints in (("prefill", prefill, prefill_events),
                                         ("decode", decode, decode_events),
                                         ("both", both, both_events)):
            for i, client in enumerate(clients):
                engine = Engine(role, client,  # type: ignore[arg-type]
                                duties=both_duties if role == "both" else frozenset())
                engine.events_endpoint = (endpoints[i] if i < len(endpoints) else None) or None
                self.engines.append(engine)
        self._metrics = metrics
        self.health_timeout_s = health_timeout_s
        self._picks = 0
        #: Pairs whose KV pulls fail are left out of the prefill picks (``proxy/pair_health.py``).
        self.pair_health = PairHealth()
        self._looks: set[asyncio.Task] = set()
        self._waiting: set[str] = set()  # engines with a look waiting for its turn
        #: Called when an engine comes up (first probe, after a restart, a new one joined).
        self.on_up: Callable[[Engine], None] | None = None
        #: The model a silent engine is asked to generate with (``proxy/stalls.py``).
        self.probe_model: str | None = None

    def all(self) -> list[Engine]:
        return list(self.engines)

    @property
    def prefill(self) -> list[Engine]:
        """Engines whose duties include prefilling for another engine."""
        return [e for e in self.engines if "prefill" in e.duties]

    @property
    def decode(self) -> list[Engine]:
        """Engines whose duties include decoding (and computing prompts on the local route)."""
        return [e for e in self.engines if "decode" in e.duties]

    def pairs(self) -> list[tuple[Engine, Engine]]:
        """Every (prefill-capable, decode-capable) pair of two engines: what warm-up handshakes
        and link probes cover, so a new assignment finds its pairs ready."""
        return [(p, d) for p in self.engines if p.can("prefill")
                for d in self.engines if d.can("decode") and d is not p]

    def assign(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        """Give the engines new duties: those named in ``prefill`` prefill for others, those in
        ``decode`` decode (a ``both`` engine either, both or neither). An engine of a fixed role
        not named for its role's duty is cordoned: it finishes what it has and is given nothing
        new (an engine that restarts or joins comes with its role's duty). Naming an engine for
        a duty its role cannot do, or leaving no engine to decode, is a ValueError."""
        new = assigned_duties(self.engines, prefill, decode)
        for e in self.engines:
            e.duties = new[e.name]

    def get(self, name: str) -> Engine | None:
        return next((e for e in self.all() if e.name == name), None)

    def reconcile(
        self, infos: Sequence[EndpointInfo], make_client: Callable[[str, str], EngineClient]
    ) -> tuple[list[Engine], list[Engine]]:
        """Make the pool match ``infos``; return (engines added, engines removed).

        An engine whose url or instance changed is a new engine (a restart: empty cache);
        in-flight requests keep the object they hold and end on their own."""
        wanted = {i.name: i for i in infos}
        removed = [e for e in self.all() if e.name not in wanted
                   or (e.client.base_url, e.instance) != (wanted[e.name].url.rstrip("/"),
                                                          wanted[e.name].instance)]
        for e in removed:
            self.set_health(e, False)
            self.engines.remove(e)
            if e.name not in wanted:  # gone (restarted, it keeps its name and its series)
                self._metrics.forget_engine(e.name)
        have = {e.name for e in self.all()}
        added = [Engine(i.role, make_client(i.name, i.url), events_endpoint=i.kv_events or None,
                        instance=i.instance) for i in infos if i.name not in have]
        self.engines += added
        for e in added + removed:
            log.info("engine %s (%s) %s: %s", e.name, e.role,
                     "joined" if e in added else "left", e.client.base_url)
        return added, removed

    def pick_prefill(self, cost: Callable[[Engine], float] = _no_cost,
                     exclude: Engine | None = None) -> Engine | None:
        """The cheapest engine to prefill for ``exclude`` (the decode engine: never itself, nor
        an engine whose KV it has been failing to pull)."""
        return self.picked(self.cheapest_prefill(cost, exclude), "prefill")

    def pick_decode(self, cost: Callable[[Engine], float] = _no_cost,
                    exclude: Collection[str] = ()) -> Engine | None:
        """The cheapest engine to decode on, none of those named in ``exclude`` (they failed)."""
        return self.picked(
            _cheapest([e for e in self.decode if e.name not in exclude], cost, "decode"), "decode")

    def usable(self, duty: str) -> list[Engine]:
        """The engines that may be given ``duty`` now, without picking one (the pair of engines
        is chosen among them where engines serve both roles: ``proxy/plan.py``)."""
        engines = self.decode if duty == "decode" else self.prefill
        return [e for e in engines if e.healthy and not e.draining]

    def cheapest_prefill(self, cost: Callable[[Engine], float], exclude: Engine | None
                         ) -> Engine | None:
        """``pick_prefill``'s engine, not recorded as picked."""
        return _cheapest(self.prefill_for(exclude), cost, "prefill")

    def prefill_for(self, decode: Engine | None) -> list[Engine]:
        """The engines that may prefill for ``decode``: not itself, and not one whose pair with
        it is routed around (its pulls failed; ``proxy/pair_health.py``)."""
        now, health = time.monotonic(), self.pair_health
        return [e for e in self.prefill if e is not decode and (
            decode is None or health.usable(e.name, decode.name, now))]

    def picked(self, engine: Engine | None, duty: str) -> Engine | None:
        """Record ``engine`` as picked for ``duty`` (ties rotate by the oldest pick)."""
        if engine is not None:
            self._picks += 1
            engine.last_pick[duty] = self._picks
        return engine

    @property
    def ready(self) -> bool:
        """A decode engine is up, and so is a prefill engine if any are configured."""
        prefill_ok = not self.prefill or any(e.healthy for e in self.prefill)
        return any(e.healthy for e in self.decode) and prefill_ok

    def mark_down(self, engine: Engine) -> None:
        if engine.healthy:
            log.warning("engine %s (%s) marked down", engine.name, engine.role)
        self.set_health(engine, False)
        # A restarted engine comes back with an empty cache.
        engine.index.apply([AllCleared()])

    def stalled(self, engine: Engine) -> None:
        """A request's wait on ``engine`` ran out: enough in a row, and its next probe asks it
        for a token; none in time, and it is down (``proxy/stalls.py``)."""
        if self.probe_model is not None and stalled(engine):
            log.warning("engine %s (%s): %d requests in a row stalled on it, nothing generated "
                        "in between: its probes now ask it for a token", engine.name,
                        engine.role, engine.stalls)

    def set_health(self, engine: Engine, healthy: bool) -> None:
        came_up = healthy and not engine.healthy
        if came_up:
            log.info("engine %s (%s) is up", engine.name, engine.role)
            self.pair_health.forget(engine.name)
        if engine.healthy and not healthy:
            self._release(engine)
        engine.healthy = healthy
        engine.consecutive_failures = 0 if healthy else engine.consecutive_failures + 1
        if engine in self.engines:  # (one that left, marked down by a late failure: no series)
            self._metrics.engine_up.labels(engine.role, engine.name).set(1 if healthy else 0)
        if came_up and self.on_up is not None:
            self.on_up(engine)

    def _release(self, engine: Engine) -> None:
        """What waits on ``engine``, now down, stops waiting: prefills fall back, its streams
        continue on another decode engine (migration), not after the idle deadline, and decode
        requests waiting for its answer go to another. With no other decode engine up, those
        two stay: the engine may be slow, and cut they'd fail."""
        replaced = any(e is not engine and e.healthy and not e.draining and "decode" in e.duties
                       for e in self.all())
        engine.give_up_waiting(replaced)
        if replaced:
            for stream in list(engine.open_streams):
                stream.close()

    async def look(self, engine: Engine) -> None:
        """Read the engine's own metrics: its load (running + waiting requests), and the KV
        pulls that failed since the last look, laid on its pairs (``proxy/pair_health.py``)."""
        async with engine.looking:
            self._waiting.discard(engine.name)
            start = self.pair_health.look_begins(engine.name, time.monotonic())
            status, text = await engine.client.get_text("/metrics", self.health_timeout_s)
            if status != 200:
                return
            failed = engine.update_load(text)
            if engine.can("decode"):  # its series, 0 until one fails
                self._metrics.kv_pull_failures_total.labels(engine.name).inc(failed)
                self.pair_health.looked(engine.name, start, failed, time.monotonic())
            if failed:
                log.warning("engine %s: %d KV pull(s) failed, so it computed those prompts; "
                            "its vLLM log says why (e.g. 'NIXL compatibility hash mismatch': "
                            "another vLLM, model path or dtype)", engine.name, failed)

    def handing_over(self, prefill: Engine, decode: Engine) -> Handover:  # to :meth:`pulled`
        return self.pair_health.opened(prefill.name, decode.name, time.monotonic())

    def pulled(self, handover: Handover) -> None:
        """The hand-over's pull is over (failed or not: the engine's count tells,
        ``proxy/pair_health.py``). A watched engine is looked at now."""
        watched = self.pair_health.pulled(handover, time.monotonic())
        decode = self.get(handover.decode) if watched else None
        if decode is not None and decode.name not in self._waiting:  # one waiting look: all
            self._waiting.add(decode.name)
            task = asyncio.get_running_loop().create_task(self._look_quietly(decode))
            self._looks.add(task)
            task.add_done_callback(self._looks.discard)

    async def _look_quietly(self, engine: Engine) -> None:  # failed: the next probe's to judge
        with contextlib.suppress(EngineUnreachable, EngineTimeout):
            await self.look(engine)

    async def probe(self, engine: Engine) -> bool:
        """One health probe (``proxy/probes.py``); whether the engine is up after it."""
        return await probes.probe(self, engine)

    async def run_health_loop(self, interval_s: float) -> None:
        await probes.run_health_loop(self, interval_s)


def _cheapest(engines: Sequence[Engine], cost: Callable[[Engine], float], duty: str
              ) -> Engine | None:
    """Not suspect before suspect (a ``silent`` engine, its requests stalled, until its token
    probe answers: ``proxy/stalls.py``); warmed up before warming; then lowest ``cost``; then
    fewest of this proxy's requests in flight; then picked longest ago."""
    usable = [e for e in engines if e.healthy and not e.draining]
    if not usable:
        return None
    return min(usable, key=lambda e: (e.silent, e.warming, cost(e), e.inflight,
                                      e.last_pick.get(duty, 0)))
