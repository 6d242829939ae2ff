"""Node-aware placement, and a node lost and back, on a real two-node Ray cluster on this machine
(``launch/netns_cluster.py``): the head in the root network namespace, a worker node in a network
namespace of its own, each with its own address, joined by the testbed's veth link.

- ``pdserve ray --prefill-on W --decode-on H,W`` puts the prefill engine on the node that offers
  W (the worker), decode-0 on the one that offers H (the head) and decode-1 beside the prefill
  engine, and the deployment serves P/D across the nodes. Each engine binds its own node's
  address, and KV crosses the link between them.
- One deployment, one prompt cached on the prefill engine, the link shaped slow: the cross-node
  pair (prefill-0 -> decode-0) recomputes it, the same-node pair (prefill-0 -> decode-1) moves
  its KV, each from its own measured link.
- The link to the prefill engine's node is cut, silently, under streaming load: the proxy takes
  the engine out within a probe round and releases the requests waiting on it to the decode
  engine; healed, the same engine serves P/D again in seconds.
- The worker node is lost under streaming load (every process in its namespace, the raylet, the
  prefill engine and decode-1 included, SIGKILLed at once): no request fails or hangs, the two
  streams decoding on decode-1 continue on decode-0 (stream migration) and end whole, the proxy
  marks the engines down, new requests are served locally by decode-0; the node comes back
  (``ray start`` there again), Ray restarts the engine actors on it, and P/D resumes, on both
  decode engines.

Apart from the pair test and those two streams, decode-1 is cordoned (``POST
/pd/admin/routing``): the load decodes on the head, which nothing here touches.

Not issue 18's item 1 in full: the worker is not started by ``ray up`` over SSH, and it shares
this machine's filesystem and venv. Needs root (network namespaces); under CI it fails instead of
skipping.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from harness.greedy_streams import greedy_streams
from harness.prompts import text_of_tokens
from harness.routes import cache_on_prefill, costs, wait_for
from harness.stack import Stack, start_ray
from launch import testbed
from launch.netns_cluster import NetnsRayCluster
from proxy.metrics import MIGRATION_REASONS as REASONS
from tests.e2e.test_zz_prefill_down import FALLBACK, UNAVAILABLE, sample

LOST = 'pd_fallbacks_total{reason="prefill_lost"}'
NIXL_BYTES = 'vllm:nixl_bytes_transferred_sum{engine="0",model_name="pdserve-tiny"}'
PORT = 19100
NAMESPACE = f"pdserve-placement-{os.getpid()}"
UNDER_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
HEAD, WORKER = "pd_test_head", "pd_test_worker"
#: decode-1 (on the worker node) cordoned: everything decodes on the head.
ON_HEAD = {"prefill": ["prefill-0"], "decode": ["decode-0"]}


@pytest.fixture(scope="module")
def two_nodes():
    if not testbed.available():
        if UNDER_CI:
            pytest.fail("CI=true but this machine cannot make network namespaces (root, ip, tc)")
        pytest.skip("needs root to make network namespaces")
    # Prefill on the worker node, decode-0 on the head: the reverse of where Ray's default
    # scheduling puts them (the first actor on the driver's node, the head), so the test
    # fails if the placement is ignored.
    with NetnsRayCluster(testbed.ThrottledLink("pdplace", 233), head_resource=HEAD,
                         worker_resource=WORKER) as cluster:
        yield cluster
    assert not cluster.pids(), "processes of the cluster left (worker namespace, or head)"
    # A later local cluster (tests/ray's own) must not mistake this one for a running cluster.
    current = Path("/tmp/ray/ray_current_cluster")
    assert not current.exists() or current.read_text().strip() != cluster.address


@pytest.fixture(scope="module")
def placed(two_nodes, tmp_path_factory):
    stack = start_ray("tiny", port=PORT, log_dir=tmp_path_factory.mktemp("placed"),
                      env=two_nodes.auth_env, extra=[
        "--address", two_nodes.address, "--namespace", NAMESPACE,
        "--prefill", "1", "--decode", "2", "--prefill-on", WORKER,
        "--decode-on", f"{HEAD},{WORKER}", "--policy", "disaggregate", "--kv-blocks", "512",
        "--probe-tokens", ""])
    try:
        routing(stack, **ON_HEAD)
        yield stack
    finally:
        left = stack.stop(timeout_s=120)
    assert not left, f"engine processes survived pdserve ray's SIGTERM: {left}"


def routing(stack: Stack, **settings) -> dict:
    r = httpx.post(stack.proxy_url + "/pd/admin/routing", json=settings, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def complete(stack: Stack, prompt: str, request_id: str, max_tokens: int = 4) -> dict:
    """A streamed completion through the proxy (a whole reply has no first-token time, so it
    measures no hand-over); returns the proxy's decision for it (engines, route, reason,
    estimates: ``/pd/decisions``)."""
    body = {"model": stack.model_name, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as c, c.stream(
            "POST", stack.proxy_url + "/v1/completions", json=body,
            headers={"x-request-id": request_id}) as r:
        lines = list(r.iter_lines())
    assert r.status_code == 200 and lines and "data: [DONE]" in lines, lines
    (decision,) = httpx.get(stack.proxy_url + "/pd/decisions", timeout=10,
                            params={"request_id": request_id}).json()["decisions"]
    assert decision["route_taken"] == r.headers["x-pd-route"], decision
    return decision | {"estimate": r.headers.get("x-pd-estimate")}


def engine_hosts(stack: Stack) -> dict[str, str]:
    """Each engine's host, as the proxy reaches it."""
    return {name: urlsplit(e["url"]).hostname for name, e in stack.engines().items()}


def test_engines_go_to_the_nodes_that_offer_their_roles_resource(two_nodes, placed):
    link = two_nodes.link
    assert engine_hosts(placed) == {"prefill-0": link.ns_addr, "decode-0": link.host_addr,
                                    "decode-1": link.ns_addr}
    r = httpx.post(placed.proxy_url + "/v1/completions", timeout=120, json={
        "model": placed.model_name, "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0})
    assert r.status_code == 200 and r.headers["x-pd-route"] == "disaggregated", r.text
    # The KV crossed the link: the decode engine's NIXL read it from the other node.
    engine_metrics = httpx.get(placed.engines()["decode-0"]["url"] + "/metrics", timeout=10)
    assert sample(engine_metrics.text, NIXL_BYTES) > 0


SLOW_MBIT = 30.0
DOC_TOKENS = 2048


def test_a_same_node_pair_and_a_cross_node_pair_decide_differently_for_one_prompt(two_nodes,
                                                                                   placed):
    """The link between the nodes shaped to 30 Mbit/s. Each pair first measures its own link
    with a few hand-overs (the other decode engine cordoned): the cross-node pair's fit reads
    the shaped rate, the same-node pair's a link over ten times faster. Then one document
    (2,048 tokens, 4 MiB of KV), cached on the prefill engine only, is sent once with each decode
    engine the only one: across the link, recomputing it is cheaper than moving it (local);
    beside the prefill engine, moving it is (disaggregated)."""
    link = two_nodes.link
    shaped = SLOW_MBIT * 1e6 / 8
    link.set_rate(testbed.LinkSpec(SLOW_MBIT))
    try:
        for i, decode in enumerate(("decode-0", "decode-1")):
            routing(placed, policy="disaggregate", prefill=["prefill-0"], decode=[decode])
            for j, n in enumerate((256, 1024, 256, 1024)):
                seen = complete(placed, text_of_tokens(n, seed=600 + 10 * i + j),
                                f"pair-probe-{decode}-{j}", max_tokens=1)
                assert (seen["route_taken"], seen["decode"]) == ("disaggregated", decode), seen
        fits = costs(placed)["links"]
        cross, same = fits["prefill-0->decode-0"], fits["prefill-0->decode-1"]
        print(f"link fits at {SLOW_MBIT:g} Mbit/s: cross-node {cross}, same-node {same}")
        assert 0.5 * shaped < cross["bytes_per_s"] < 1.5 * shaped, cross
        assert same["bytes_per_s"] > 10 * shaped, same

        doc = text_of_tokens(DOC_TOKENS, seed=677)
        placed.prefill_url = placed.engines()["prefill-0"]["url"]
        cache_on_prefill(placed, doc, DOC_TOKENS)
        decided = {}
        for decode in ("decode-0", "decode-1"):
            routing(placed, policy="auto", decode=[decode])
            wait_for(lambda: all(e["engine_requests"] == 0
                                 for e in costs(placed)["engines"].values()),
                     "the proxy to see every engine idle", timeout_s=30)
            decided[decode] = complete(placed, doc + " and then", f"pair-doc-{decode}", 2)
        print(f"one prompt, two pairs: {decided}")
        assert decided["decode-0"]["route_taken"] == "local", decided
        assert decided["decode-1"]["route_taken"] == "disaggregated", decided
        assert decided["decode-1"]["prefill"] == "prefill-0", decided
    finally:
        link.set_rate(testbed.UNTHROTTLED)
        routing(placed, policy="disaggregate", **ON_HEAD)


def stream(stack: Stack, max_tokens: int) -> dict:
    """One streamed completion through the proxy, as a client sees it. A read that waits over
    60 s raises: a hung stream fails the test."""
    sent = time.monotonic()
    body = {"model": stack.model_name, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, \
            c.stream("POST", stack.proxy_url + "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        status, route = r.status_code, r.headers.get("x-pd-route")
    events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", [])
                if c.get("finish_reason")]
    return {"sent": sent, "took": time.monotonic() - sent, "status": status, "route": route,
            "finishes": finishes, "errors": [e for e in events if "error" in e],
            "done": bool(lines) and lines[-1] == "data: [DONE]"}


def prefill_healthy(stack: Stack) -> bool:
    r = httpx.get(stack.proxy_url + "/pd/costs", timeout=10)
    return r.json()["engines"]["prefill-0"]["healthy"]


def metrics(stack: Stack) -> str:
    return httpx.get(stack.proxy_url + "/metrics", timeout=10).text


def prefill_instance(stack: Stack) -> str:
    """Which incarnation of the prefill engine the proxy sees (changes when it restarts)."""
    return httpx.get(stack.proxy_url + "/pd/costs", timeout=10).json()[
        "engines"]["prefill-0"]["instance"]


@dataclass
class Load:
    """Streams through the proxy while a test breaks something: two long ones (decoding on the
    head, which nothing here touches) and short ones one after another."""

    pool: ThreadPoolExecutor
    short: list[dict] = field(default_factory=list)
    long: list[Future] = field(default_factory=list)

    def since(self, t: float) -> list[dict]:
        return [r for r in self.short if r["sent"] > t]

    def everything(self) -> list[dict]:
        """Every stream, once the load is over."""
        return [*(f.result() for f in self.long), *self.short]


@contextlib.contextmanager
def streaming_load(stack: Stack) -> Iterator[Load]:
    """The load, running from the first three short streams served until the block ends."""
    stop = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        load = Load(pool)
        load.long = [pool.submit(stream, stack, 200) for _ in range(2)]

        def trickle() -> None:
            while not stop.is_set():
                load.short.append(stream(stack, 8))

        ticker = pool.submit(trickle)
        try:
            wait_for(lambda: len(load.short) >= 3, "the trickle to be served P/D", timeout_s=60)
            yield load
        finally:
            stop.set()
        ticker.result()


def assert_all_whole(streams: list[dict]) -> None:
    """200, one ``finish_reason`` (the length asked), ``[DONE]``, no error event."""
    for r in streams:
        assert r["status"] == 200 and r["done"] and not r["errors"], r
        assert r["finishes"] == ["length"], r


def test_a_cut_link_is_routed_around_within_a_probe_round_and_heals_in_seconds(two_nodes,
                                                                                placed):
    """The link to the prefill engine's node cut silently (a partition: nothing answers,
    nothing refuses) under streaming load. The proxy marks the engine down within a probe
    round (its /health times out, then not even a new connection opens), and the requests
    already waiting on it go local at that moment (``pd_fallbacks_total{reason="prefill_lost"}``)
    rather than when their connections fail: here after 8 s, when the veth's neighbour entry
    fails; across a router, never before the 120-s prefill deadline. New ones go local. The link
    healed, the same engine process (the cut was too short for Ray to drop the node) serves
    P/D again within seconds: nothing to restart."""
    link = two_nodes.link
    wait_for(lambda: prefill_healthy(placed), "prefill up", timeout_s=120)
    instance = prefill_instance(placed)
    before = metrics(placed)
    with streaming_load(placed) as load:
        cut = time.monotonic()
        link.cut()
        # Sent before any probe can notice: it waits on the prefill engine (the trickle's
        # request in flight may be past its prefill, pulling KV).
        caught_at_once = load.pool.submit(stream, placed, 8)
        try:
            wait_for(lambda: not prefill_healthy(placed), "the proxy to mark prefill down",
                     timeout_s=60)
            marked_down_s = time.monotonic() - cut
            down = time.monotonic()
            wait_for(lambda: len(load.since(down)) >= 3,
                     "requests served while the link is cut", timeout_s=60)
            # Still cut: without the release it waits for its connection to fail.
            wait_for(caught_at_once.done, "the request sent at the cut to be answered",
                     timeout_s=30)
        finally:
            healed = time.monotonic()
            link.set_rate(testbed.UNTHROTTLED)
        wait_for(lambda: any(r["route"] == "disaggregated" for r in load.since(healed)),
                 "P/D again once the link is healed", timeout_s=120)
        serving_again_s = time.monotonic() - healed
    after = metrics(placed)
    caught = [r for r in [*load.short, caught_at_once.result()] if cut - 1 < r["sent"] < down]
    print(f"link cut: prefill marked down after {marked_down_s:.2f}s; requests caught by the "
          f"cut took {sorted(round(r['took'], 2) for r in caught)}s (routes "
          f"{[r['route'] for r in caught]}); healed: P/D again after {serving_again_s:.1f}s")
    assert_all_whole([*load.everything(), caught_at_once.result()])
    lost = sample(after, LOST) - sample(before, LOST)
    assert lost >= 1, "no request was waiting on the prefill engine when it was cut off"
    assert caught_at_once.result()["route"] == "local"
    assert caught_at_once.result()["took"] < marked_down_s + 5
    assert all(r["took"] < marked_down_s + 15 for r in caught), caught
    # Sent and answered while it was cut: local. (One sent just before the heal may be planned
    # after a probe found the engine again: a run on a loaded box saw one P/D in that window.)
    within = [r for r in load.short if down < r["sent"] and r["sent"] + r["took"] < healed]
    assert within and all(r["route"] == "local" for r in within), load.short
    assert prefill_instance(placed) == instance, "the engine was restarted: nothing to heal"


DOOMED, DOOMED_TOKENS = 2, 160


def test_a_lost_node_is_served_around_and_serves_again_when_back(two_nodes, placed):
    """The worker node lost under streaming load, with the prefill engine and two greedy
    streams decoding on decode-1 there: those streams continue on decode-0 (stream migration,
    across the loss of a node) and end whole; see the module docstring for the rest."""
    cluster = two_nodes
    assert prefill_healthy(placed)
    before = metrics(placed)
    prompts = [text_of_tokens(40, seed=800 + i) for i in range(DOOMED)]
    lost = 0.0

    def lose() -> None:
        """Once both streams are decoding on decode-1: new work goes to the head, and the
        worker node is gone."""
        nonlocal lost
        routing(placed, **ON_HEAD)
        lost = time.monotonic()
        cluster.lose_worker()

    with streaming_load(placed) as load:
        routing(placed, prefill=["prefill-0"], decode=["decode-1"])
        doomed = load.pool.submit(lambda: asyncio.run(greedy_streams(
            placed.proxy_url, placed.model_name, prompts, DOOMED_TOKENS, kill=lose)))
        wait_for(lambda: lost or doomed.done(), "the streams on decode-1 to start",
                 timeout_s=120)
        assert lost, doomed.result()  # (raises what the streams raised)
        wait_for(lambda: not prefill_healthy(placed), "the proxy to mark prefill down",
                 timeout_s=30)
        marked_down_s = time.monotonic() - lost
        down = time.monotonic()
        wait_for(lambda: len(load.since(down)) >= 3,
                 "requests served while the node is gone", timeout_s=60)
        back = time.monotonic()
        cluster.rejoin_worker()
        wait_for(lambda: any(r["route"] == "disaggregated" for r in load.since(back)),
                 "P/D again once the node is back", timeout_s=300)
        serving_again_s = time.monotonic() - back
    after = metrics(placed)
    print(f"prefill node lost: marked down after {marked_down_s:.2f}s; node back: P/D again "
          f"after {serving_again_s:.1f}s; {len(load.short)} short streams, "
          f"{sample(after, FALLBACK) - sample(before, FALLBACK):.0f} of them sent to the lost "
          "engine and computed by decode instead")
    assert_all_whole(load.everything())
    assert all(r["route"] == "local" for r in load.short if down < r["sent"] < back), load.short
    assert sample(after, UNAVAILABLE) > sample(before, UNAVAILABLE)
    # The streams that were decoding on the lost node: continued elsewhere, one whole stream
    # each (one id, one finish, every token counted once).
    moved = doomed.result()
    migrated = sum(sample(after, f'pd_migrations_total{{reason="{r}"}}')
                   - sample(before, f'pd_migrations_total{{reason="{r}"}}') for r in REASONS)
    print(f"streams on the lost node: {migrated:.0f} migrations; longest gap per stream (s): "
          f"{sorted(round(max(r.gaps()), 3) for r in moved)}")
    assert migrated >= DOOMED, migrated
    assert [r.finish for r in moved] == ["length"] * DOOMED, moved
    assert all(r.one_stream() and r.usage and r.usage[1] == DOOMED_TOKENS for r in moved), moved
    # The restarted engines are on the node that came back, and decode-1 (restarted: a new
    # engine, no longer cordoned) serves again too.
    assert engine_hosts(placed) == {"prefill-0": cluster.link.ns_addr,
                                    "decode-0": cluster.link.host_addr,
                                    "decode-1": cluster.link.ns_addr}
    routing(placed, decode=["decode-1"])
    wait_for(lambda: placed.engines()["decode-1"]["healthy"]
             and not placed.engines()["decode-1"]["warming"], "decode-1 up", timeout_s=120)
    served = complete(placed, "The capital of France is", "node-back-1")
    assert (served["route_taken"], served["decode"]) == ("disaggregated", "decode-1"), served
    routing(placed, **ON_HEAD)
