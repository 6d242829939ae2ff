"""The proxy's parts, put together: the composition root the routes serve from.

``service = await ProxyService.start(config, directory, scaler)`` builds everything (engine
pool and clients, prompt measuring, cost model and ledger, orchestrator, KV-event feeds,
discovery, health and warm-up tasks) and returns only once it is whole; ``await
service.stop()`` cancels every task and closes every connection, once. Between the two, the
routes use its attributes and :meth:`discover`, :meth:`scale`, :meth:`set_routing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import zmq.asyncio

from proxy.admission import Admission
from proxy.config import ProxyConfig
from proxy.costs import RouteCosts
from proxy.directory import Directory, Restarter, Scaler
from proxy.engine_client import EngineClient, new_session
from proxy.errors import UpstreamError
from proxy.http1 import Client
from proxy.kv_event_feed import run_feed
from proxy.loop_lag import watch_loop_lag
from proxy.metrics import ProxyMetrics
from proxy.orchestrator import Orchestrator
from proxy.policy import PolicyMode, Targets, parse_policy
from proxy.pool import BOTH, Engine, EnginePool
from proxy.scale_down import drain, pick_removals, undrain
from proxy.stalls import restart_hung
from proxy.tokenizer_pool import TokenizerPool
from proxy.warmup import reprobe_links, reprobe_sizes, warm_up_at_start, warm_up_engine

if TYPE_CHECKING:
    from proxy.tracing import Tracing

log = logging.getLogger(__name__)

#: Discovery rounds (a second each) between two checks for engines dead for good.
RECONCILE_EVERY = 5


class ProxyService:
    def __init__(self, config: ProxyConfig, directory: Directory | None, scaler: Scaler | None,
                 session: Client, pool: EnginePool, prompts: TokenizerPool | None,
                 metrics: ProxyMetrics, zmq_context: zmq.asyncio.Context):
        """Use :meth:`start`."""
        self.config = config
        self.directory = directory
        self.scaler = scaler
        self.restarter: Restarter | None = None  # (set by :meth:`start`)
        self.session = session
        self.pool = pool
        self.prompts = prompts
        self.metrics = metrics
        self.costs = RouteCosts(config.kv_bytes_per_token or 1,
                                chunk_tokens=config.decode_chunk_tokens,
                                on_arrival=lambda route, predicted, measured: (
                                    metrics.itl_prediction_ratio.labels(route).observe(
                                        measured / predicted) if predicted else None))
        self.orchestrator = Orchestrator(
            pool, parse_policy(config.policy), config.deadlines(), metrics, self.costs, prompts,
            targets=Targets(
                ttft_s=config.slo_ttft_ms / 1e3 if config.slo_ttft_ms else None,
                itl_s=config.slo_itl_ms / 1e3 if config.slo_itl_ms else None),
            migration_limit=config.migration_limit, max_model_len=config.max_model_len)
        self.admission = Admission(config.max_inflight, config.max_queued,
                                   config.queue_timeout_s)
        metrics.queued_requests.set_function(lambda: self.admission.queued)
        self.warmed = not config.warmup
        #: One trace per request, when an OTLP endpoint is configured (else nothing is made).
        self.tracing: Tracing | None = None
        if config.otlp_traces_endpoint:
            from proxy.tracing import Tracing

            self.tracing = Tracing(config.otlp_traces_endpoint)
        self._zmq = zmq_context
        self._feeds: dict[Engine, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._scale_lock = asyncio.Lock()
        #: Engines per role the deployment keeps (Ray mode: its start, then each scale order).
        self.declared = {"prefill": len(config.prefill_urls), "decode": len(config.decode_urls)}

    @classmethod
    async def start(cls, config: ProxyConfig, directory: Directory | None = None,
                    scaler: Scaler | None = None, restarter: Restarter | None = None
                    ) -> ProxyService:
        metrics = ProxyMetrics()
        session = new_session(config.engine_key)

        def clients(role: str, urls: Sequence[str]) -> list[EngineClient]:
            return [EngineClient(f"{role}-{i}", url, session) for i, url in enumerate(urls)]

        pool = EnginePool(
            clients("prefill", config.prefill_urls), clients("decode", config.decode_urls),
            metrics, prefill_events=config.prefill_kv_events,
            decode_events=config.decode_kv_events, both=clients("engine", config.pool_urls),
            both_events=config.pool_kv_events,
            both_duties=BOTH if config.layout == "pool" else frozenset({"decode"}))
        prompts = (await TokenizerPool.start(config.tokenizer, config.tokenizer_workers,
                                             config.tokenizer_inline_chars)
                   if config.tokenizer else None)
        pool.probe_model = config.served_model_names[0]  # (a silent engine's probe)
        service = cls(config, directory, scaler, session, pool, prompts, metrics,
                      zmq.asyncio.Context())
        service.restarter = restarter
        try:
            await service._run()
        except BaseException:
            await service.stop()
            raise
        return service

    async def _run(self) -> None:
        for engine in self.pool.all():
            self._start_feed(engine)
        if self.directory is not None:
            await self.discover()
            self._tasks.append(self._background(self._discovery_loop(), "discovery"))
        if self.config.loop_lag_probe_s > 0:
            self._tasks.append(self._background(watch_loop_lag(
                self.metrics.event_loop_lag_seconds, self.config.loop_lag_probe_s), "loop lag"))
        await asyncio.gather(*(self.pool.probe(e) for e in self.pool.all()))
        self._tasks.append(self._background(
            self.pool.run_health_loop(self.config.health_interval_s), "health"))
        if not self.warmed:
            self._tasks.append(self._background(self._warm_up(), "warm-up"))
        if self.restarter is not None and self.config.hung_restart_s > 0:
            self._tasks.append(self._background(restart_hung(
                self.pool.all, self.restarter, self.config.hung_restart_s), "hung engines"))
        # Everything built so far lives as long as the proxy (the app, the tokenizer, the
        # modules under them; ~380k objects when transformers brought torch in). Frozen, the
        # garbage collector no longer walks them: a full collection held the loop 130-180 ms.
        gc.freeze()

    @property
    def ready(self) -> bool:
        return self.pool.ready and self.warmed

    # -- membership -------------------------------------------------------------------------
    def _start_feed(self, engine: Engine) -> None:
        if engine.events_endpoint:
            self._feeds[engine] = self._background(
                run_feed(engine.events_endpoint, engine.index, self._zmq),
                f"KV events of {engine.name}")

    async def discover(self) -> None:
        """Reconcile the pool with the directory: new engines get a KV-event feed and a health
        probe at once; gone or restarted ones lose theirs."""
        assert self.directory is not None
        infos = await self.directory.endpoints()
        added, removed = self.pool.reconcile(
            infos, lambda name, url: EngineClient(name, url, self.session))
        for engine in removed:
            if (task := self._feeds.pop(engine, None)) is not None:
                task.cancel()
        for engine in added:
            self._start_feed(engine)
        if added:
            await asyncio.gather(*(self.pool.probe(e) for e in added))

    async def _discovery_loop(self, interval_s: float = 1.0) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(interval_s)
            rounds += 1
            if rounds % RECONCILE_EVERY == 0:
                await self.keep_declared()
            try:
                await self.discover()
            except Exception:  # a directory hiccup must not stop discovery
                log.exception("engine discovery failed; keeping the current pool")

    async def keep_declared(self) -> None:
        """Have the scaler replace the engines dead for good (skipped while a scale order
        runs: it settles them itself). A failure is logged; the next round tries again."""
        if self.scaler is None or self._scale_lock.locked():
            return
        try:
            async with self._scale_lock:
                started = await self.scaler.reconcile(self.declared)
        except Exception:
            log.exception("replacing dead engines failed; trying again next round")
            return
        for role, names in started.items():
            self.metrics.engine_replacements_total.labels(role).inc(len(names))

    async def scale(self, role: str, replicas: int, drain_timeout_s: float) -> dict[str, Any]:
        """Grow or shrink ``role`` to ``replicas`` engines; shrinking drains first (nothing in
        flight is dropped), engines that are down go first, then the newest. A removal that
        fails is an UpstreamError (502), the engines it was for undrained."""
        assert self.scaler is not None
        async with self._scale_lock:
            names = await self.scaler.replicas(role)  # type: ignore[arg-type]
            added: list[str] = []
            removed: list[str] = []
            drained = True
            if replicas > len(names):
                added = await self.scaler.add(role, replicas - len(names))  # type: ignore[arg-type]
            elif replicas < len(names):
                removed = pick_removals(names, replicas, self._is_up)
                try:
                    drained = await drain(self.pool, removed, drain_timeout_s)
                    await self.scaler.remove(removed)
                except BaseException as exc:
                    undrain(self.pool, removed)
                    if not isinstance(exc, Exception):
                        raise
                    log.exception("scale-down of %s failed", ", ".join(removed))
                    raise UpstreamError(f"removing {', '.join(removed)} failed; they serve "
                                        "again (the proxy's log says why)") from exc
            self.declared[role] = replicas
            await self.discover()
            return {"role": role, "replicas": replicas, "added": added, "removed": removed,
                    "drained": drained}

    def _is_up(self, name: str) -> bool:
        engine = self.pool.get(name)
        return engine is not None and engine.healthy

    # -- routing ----------------------------------------------------------------------------
    def routing(self) -> dict[str, Any]:
        return {"policy": str(self.orchestrator.policy),
                "engines": {e.name: {"role": e.role, "duties": sorted(e.duties)}
                            for e in self.pool.all()}}

    def set_routing(self, policy: PolicyMode | None, prefill: Sequence[str] | None,
                    decode: Sequence[str] | None) -> dict[str, Any]:
        """Switch the policy and the engines' duties (what is unset stays); ValueError
        when the duties are impossible, and then nothing changed."""
        if prefill is not None or decode is not None:
            now = {"prefill": [e.name for e in self.pool.prefill],
                   "decode": [e.name for e in self.pool.decode]}
            self.pool.assign(prefill if prefill is not None else now["prefill"],
                             decode if decode is not None else now["decode"])
        if policy is not None:
            self.orchestrator.policy = policy
        log.info("routing now %s", self.routing())
        return self.routing()

    # -- warm-up ----------------------------------------------------------------------------
    async def _warm_up(self) -> None:
        """Handshake every pair, seed the cost model, report ready, then keep links measured."""
        model = self.config.served_model_names[0]
        # An engine that joins or comes back pays its handshakes before users do (a restarted
        # engine has a new NIXL agent: every pair handshakes again); from the start, so that
        # one only up once the start-up warm-up is past its pairs is warmed too.
        self.pool.on_up = lambda engine: self._spawn(warm_up_engine(self.pool, engine, model))
        try:
            await warm_up_at_start(self.orchestrator, model, self.config.probe_tokens)
        finally:
            self.warmed = True  # failures are logged; requests are served either way
        if self.config.reprobe_s > 0 and self.config.probe_tokens:
            await reprobe_links(self.orchestrator, model,
                                reprobe_sizes(self.config.probe_tokens), self.config.reprobe_s)

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` in the background until it ends or the proxy stops."""
        task = self._background(work, "engine warm-up")
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    @staticmethod
    def _background(work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """A task for ``work``, whose death by an exception is logged when it happens (nobody
        awaits it before :meth:`stop`)."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        task.add_done_callback(_report_death)
        return task

    async def stop(self) -> None:
        """Cancel every task, then close everything, each close whatever came before it."""
        async with contextlib.AsyncExitStack() as closing:  # closes last pushed first
            closing.callback(self._zmq.term)
            if self.tracing is not None:  # flushes the last spans
                closing.push_async_callback(asyncio.to_thread, self.tracing.shutdown)
            if self.prompts is not None:
                closing.push_async_callback(self.prompts.close)
            closing.push_async_callback(self.session.close)
            tasks = [*self._tasks, *self._feeds.values()]
            for task in tasks:
                task.cancel()
            ended = await asyncio.gather(*tasks, return_exceptions=True)
            for task, result in zip(tasks, ended):
                if isinstance(result, Exception):  # (not a cancel: a BaseException)
                    log.error("background task %s had failed: %r", task.get_name(), result)


def _report_death(task: asyncio.Task) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("background task %s died; the proxy goes on without it", task.get_name(),
                  exc_info=exc)
