"""A prefill -> decode pair whose KV pulls fail is routed around (``proxy/pair_health.py``):
the rule that lays a decode engine's failed pulls on its pairs, the backoff, and the picks
through the pool and the plan. The real pair (a prefill engine the decode engine's NIXL
refuses) is ``tests/e2e/test_pair_routed_around.py``."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.metrics import ProxyMetrics
from proxy.pair_health import Handover, PairHealth, blame
from proxy.pool import EnginePool
from tests.proxy.test_kv_pull_failures import MetricsClient
from tests.proxy.test_routing import Named, request, setup


@pytest.mark.parametrize("handovers, failed, blamed", [
    ({}, 0, set()),
    ({}, 2, set()),  # failures with no hand-over in the window: nobody to blame
    ({"p0": 3}, 0, set()),
    ({"p0": 3}, 3, {"p0"}),
    ({"p0": 3}, 1, {"p0"}),  # one pair in the window: whatever failed was its
    ({"p0": 1}, 1, {"p0"}),
    ({"p0": 2}, 5, {"p0"}),  # a count that lagged the look before
    ({"p0": 2, "p1": 1}, 3, {"p0", "p1"}),  # all failed
    ({"p0": 2, "p1": 3}, 3, {"p1"}),  # exactly p1's: its pulls failed, p0's did not
    ({"p0": 2, "p1": 3}, 2, {"p0"}),
    ({"p0": 3, "p1": 3}, 3, set()),  # either one: cannot tell
    ({"p0": 2, "p1": 3}, 1, set()),  # some of someone's: cannot tell
    ({"p0": 0, "p1": 2}, 2, {"p1"}),
    ({"p0": 0, "p1": 2}, 1, {"p1"}),  # (no hand-over of p0's: p1 alone)
])
def test_blame(handovers, failed, blamed):
    assert blame(handovers, failed) == blamed


@pytest.mark.parametrize("handovers, failed, blamed", [
    ({"p0": 2, "p1": 1}, 1, set()),  # whole, p1 exactly; open, p0's may fail later
    ({"p0": 2, "p1": 1}, 2, {"p0"}),  # more than p1 could have
    ({"p0": 2, "p1": 1}, 3, {"p0", "p1"}),
    ({"p0": 3, "p1": 1}, 3, {"p0"}),  # more than p1 could have: p0's, surely
    ({"p0": 2}, 1, {"p0"}),
])
def test_blame_with_hand_overs_still_open(handovers, failed, blamed):
    assert blame(handovers, failed, whole=False) == blamed


def hand_over(health: PairHealth, prefill: str, sent: float, done: float | None = None
              ) -> Handover:
    """A hand-over of ``prefill``'s KV to d0 sent at ``sent``, pulled at ``done`` (``sent`` if
    not given; None for ``done=-1``: still open)."""
    h = health.opened(prefill, "d0", sent)
    if done != -1:
        health.pulled(h, sent if done is None else done)
    return h


def look(health: PairHealth, failed: int, now: float) -> frozenset[str]:
    """A look at d0, its read sent and answered at ``now``, finding ``failed`` new failed
    pulls."""
    return health.looked("d0", health.look_begins("d0", now), failed, now)


def test_a_blamed_pair_is_left_out_for_a_doubling_backoff_and_cleared_by_clean_pulls():
    health = PairHealth(backoff_s=10.0, max_backoff_s=25.0)
    hand_over(health, "p0", 99.0)
    hand_over(health, "p1", 99.0)
    hand_over(health, "p1", 99.0)
    assert look(health, 2, now=100.0) == {"p1"}
    assert not health.usable("p1", "d0", 109.9) and health.usable("p1", "d0", 110.0)
    assert health.usable("p0", "d0", 100.0) and health.usable("p1", "d1", 100.0)
    assert health.routed_around(105.0) == [
        {"prefill": "p1", "decode": "d0", "for_s": 5.0, "times_blamed": 1}]
    # Tried again after the backoff, and failing again: twice as long, then capped.
    hand_over(health, "p1", 110.0)
    assert look(health, 1, now=110.0) == {"p1"}
    assert not health.usable("p1", "d0", 129.9) and health.usable("p1", "d0", 130.0)
    hand_over(health, "p1", 130.0)
    look(health, 1, now=130.0)
    assert not health.usable("p1", "d0", 154.9) and health.usable("p1", "d0", 155.0)
    # A hand-over sent after the last look and pulled before this one, with no failure,
    # starts the pair afresh: the next failure costs the first backoff again.
    hand_over(health, "p1", 155.0)
    assert look(health, 0, now=160.0) == frozenset()
    hand_over(health, "p1", 165.0)
    look(health, 1, now=170.0)
    assert not health.usable("p1", "d0", 179.9) and health.usable("p1", "d0", 180.0)


def test_a_look_that_cannot_tell_neither_blames_nor_clears():
    health = PairHealth(backoff_s=10.0)
    hand_over(health, "p1", 0.0)
    look(health, 1, now=0.0)  # p1 blamed: next backoff 20 s
    for p in ("p0", "p0", "p1", "p1"):
        hand_over(health, p, 5.0)
    assert not health.watching("d0", 10.0)
    assert look(health, 2, now=10.0) == frozenset()  # p0's or p1's: unknown
    assert health.watching("d0", 10.0) and not health.watching("d1", 10.0)
    assert not health.watching("d0", 40.0)  # (for 30 s)
    hand_over(health, "p1", 10.0)
    look(health, 1, now=10.0)
    assert not health.usable("p1", "d0", 29.9)  # the backoff kept doubling


def test_an_engine_that_comes_up_starts_with_clean_pairs_and_no_window():
    health = PairHealth(backoff_s=10.0)
    hand_over(health, "p1", 0.0)
    look(health, 1, now=0.0)
    hand_over(health, "p1", 0.5)  # sent before the restart: not the new engine's
    health.forget("p1")
    assert health.usable("p1", "d0", 0.0) and health.routed_around(0.0) == []
    assert look(health, 1, now=1.0) == frozenset()


def test_a_failure_counted_before_its_hand_over_is_pulled_is_not_laid_on_another_pair():
    """vLLM counts a failed pull when it finds it, then computes the prompt, then answers: a
    look in between holds the failure of a hand-over still open. Its window alone (p0's two
    pulled hand-overs) would blame p0."""
    health = PairHealth(backoff_s=10.0)
    look(health, 0, now=0.0)
    hand_over(health, "p0", 1.0)
    hand_over(health, "p0", 2.0)
    p1 = hand_over(health, "p1", 3.0, done=-1)  # its pull failed; the prompt is computed
    assert look(health, 1, now=4.0) == frozenset()  # p0's or p1's: unknown
    assert health.usable("p0", "d0", 4.0) and health.watching("d0", 4.0)
    # Pulled after that look, it proves nothing either way; the next hand-over alone does.
    health.pulled(p1, 5.0)
    assert look(health, 0, now=6.0) == frozenset()
    hand_over(health, "p1", 7.0)
    assert look(health, 1, now=8.0) == {"p1"}


def test_a_pair_with_a_hand_over_still_open_is_not_blamed_by_an_exact_count():
    """p0 fails every pull, p1 none: one p0 pull failed, one p1 pull went through, and p0's
    next is open (its failure not yet counted). {p0: 2, p1: 1} with one failure: "exactly
    p1's" would blame the wrong pair (a CI run of the real test did)."""
    health = PairHealth(backoff_s=10.0)
    look(health, 0, now=0.0)
    hand_over(health, "p0", 1.0)
    hand_over(health, "p1", 2.0)
    hand_over(health, "p0", 3.0, done=-1)
    assert look(health, 1, now=4.0) == frozenset()
    assert health.usable("p1", "d0", 4.0) and health.watching("d0", 4.0)


def test_a_hand_over_pulled_while_the_read_is_under_way_is_in_the_reckoning():
    health = PairHealth(backoff_s=10.0)
    look(health, 0, now=0.0)
    hand_over(health, "p0", 1.0)
    start = health.look_begins("d0", 2.0)
    hand_over(health, "p1", 2.5, done=3.0)  # its failure may be in the count read
    assert health.looked("d0", start, 1, 3.5) == frozenset()  # p0's or p1's: unknown
    assert health.usable("p0", "d0", 3.5) and health.watching("d0", 3.5)
    # Pulled after that read was sent, it is still counted by the next look.
    hand_over(health, "p1", 4.0)
    assert look(health, 1, now=5.0) == {"p1"}


def test_a_look_that_could_not_read_the_count_leaves_its_hand_overs_to_the_next():
    health = PairHealth(backoff_s=10.0)
    look(health, 0, now=0.0)
    for _ in range(3):
        hand_over(health, "p1", 1.0)
    health.look_begins("d0", 2.0)  # the read timed out: looked() is never called
    hand_over(health, "p0", 3.0)
    assert look(health, 3, now=4.0) == {"p1"}  # exactly p1's three, not all on p0


def test_a_look_under_way_when_an_engine_comes_up_blames_no_one():
    """The count read may hold the failures of the engine that was there before."""
    health = PairHealth(backoff_s=10.0)
    look(health, 0, now=0.0)
    hand_over(health, "p0", 1.0)
    hand_over(health, "p1", 1.0)
    start = health.look_begins("d0", 2.0)
    health.forget("p1")  # p1 came up again: its failed hand-over is no longer counted
    assert health.looked("d0", start, 1, 3.0) == frozenset()
    assert health.usable("p0", "d0", 3.0)


def test_failures_found_while_the_pair_is_left_out_do_not_lengthen_it():
    """They are of hand-overs sent before it was left out: nothing new about the pair."""
    health = PairHealth(backoff_s=10.0)
    hand_over(health, "p1", 0.0)
    late = hand_over(health, "p1", 0.0, done=-1)
    assert look(health, 1, now=1.0) == {"p1"}  # left out until 11 s
    health.pulled(late, 1.5)
    assert look(health, 1, now=2.0) == {"p1"}  # the other one's
    assert health.usable("p1", "d0", 11.0)
    assert health.routed_around(2.0)[0]["times_blamed"] == 2


def pool_with_failing_pair() -> tuple[EnginePool, MetricsClient]:
    client = MetricsClient("d0")
    pool = EnginePool([Named("p0"), Named("p1")], [client], ProxyMetrics())
    for e in pool.all():
        e.healthy = True
    return pool, client


async def test_the_probe_blames_and_the_picks_route_around_the_pair():
    pool, client = pool_with_failing_pair()
    decode = pool.get("d0")
    await pool.probe(decode)  # the baseline
    for p in ("p0", "p1", "p1"):
        pool.pulled(pool.handing_over(pool.get(p), decode))
    client.failed = 2
    await pool.probe(decode)
    assert [pool.pick_prefill(exclude=decode).name for _ in range(4)] == ["p0"] * 4
    assert {pool.pick_prefill(exclude=None).name for _ in range(4)} == {"p0", "p1"}  # (none)


async def test_the_pair_is_tried_again_after_its_backoff():
    pool, client = pool_with_failing_pair()
    pool.pair_health = PairHealth(backoff_s=0.05)
    decode = pool.get("d0")
    await pool.probe(decode)
    pool.pulled(pool.handing_over(pool.get("p1"), decode))
    client.failed = 1
    await pool.probe(decode)
    assert {pool.pick_prefill(exclude=decode).name for _ in range(4)} == {"p0"}
    await asyncio.sleep(0.1)
    assert {pool.pick_prefill(exclude=decode).name for _ in range(4)} == {"p0", "p1"}


async def test_an_engine_coming_back_up_is_picked_again_at_once():
    pool, client = pool_with_failing_pair()
    decode = pool.get("d0")
    await pool.probe(decode)
    pool.pulled(pool.handing_over(pool.get("p1"), decode))
    client.failed = 1
    await pool.probe(decode)
    pool.mark_down(pool.get("p1"))
    pool.set_health(pool.get("p1"), True)  # (what a good probe does: a restart came up)
    assert {pool.pick_prefill(exclude=decode).name for _ in range(4)} == {"p0", "p1"}


async def test_with_every_pair_failing_the_request_goes_local_and_says_why():
    pool, _, orch = setup(prefills=("p0",), decodes=("d0",))
    hand_over(orch.pool.pair_health, "p0", time.monotonic())
    look(orch.pool.pair_health, 1, now=time.monotonic())
    plan = await orch.plan(request())
    assert plan.prefill is None and plan.decision.route == "local"
    assert plan.decision.reason == "kv_pulls_failing"
    pool.get("p0").healthy = False  # no prefill engine up at all: the usual reason
    assert (await orch.plan(request())).decision.reason == "prefill_unavailable"


def record_reads(client: MetricsClient) -> list[str]:
    """The paths the pool reads from ``client`` from now on."""
    reads: list[str] = []
    get_text = client.get_text

    async def recorded(path, timeout_s):
        reads.append(path)
        return await get_text(path, timeout_s)

    client.get_text = recorded  # type: ignore[method-assign]
    return reads


async def test_a_watched_engine_is_looked_at_after_each_hand_over_until_the_pair_is_found():
    """Round robin over two prefill engines puts as many hand-overs of each in every probe's
    window: the probes alone could never tell which pair fails. Watched, the engine is read
    after each hand-over, and the first look with the failing pair's hand-over alone finds it."""
    pool, client = pool_with_failing_pair()
    decode, p0, p1 = pool.get("d0"), pool.get("p0"), pool.get("p1")
    reads = record_reads(client)
    await pool.probe(decode)
    for p in (p0, p1):
        pool.pulled(pool.handing_over(p, decode))
    client.failed += 1  # p1's
    await pool.probe(decode)
    assert pool.pair_health.routed_around(time.monotonic()) == []  # one of two: unknown
    reads.clear()
    pool.pulled(pool.handing_over(p0, decode))
    await asyncio.sleep(0.01)  # (the look runs on the loop)
    assert reads == ["/metrics"]
    client.failed += 1
    pool.pulled(pool.handing_over(p1, decode))
    await asyncio.sleep(0.01)
    assert [r["prefill"] for r in pool.pair_health.routed_around(time.monotonic())] == ["p1"]
    assert {pool.pick_prefill(exclude=decode).name for _ in range(4)} == {"p0"}


async def test_an_engine_not_watched_is_read_only_by_its_probes():
    pool, client = pool_with_failing_pair()
    decode = pool.get("d0")
    reads = record_reads(client)
    pool.pulled(pool.handing_over(pool.get("p0"), decode))
    await asyncio.sleep(0.01)
    assert reads == []


async def test_a_burst_of_hand_overs_to_a_watched_engine_waits_for_one_look_not_one_each():
    """Read after every hand-over, a busy engine would serve a /metrics read per request: a
    look waiting for its turn takes every hand-over made before it starts."""
    pool, client = pool_with_failing_pair()
    decode, p0, p1 = pool.get("d0"), pool.get("p0"), pool.get("p1")
    await pool.probe(decode)
    for p in (p0, p1):
        pool.pulled(pool.handing_over(p, decode))
    client.failed += 1
    await pool.probe(decode)  # one of two: the engine is watched now
    reads = record_reads(client)
    release = asyncio.Event()
    read = client.get_text

    async def slow(path, timeout_s):
        await release.wait()
        return await read(path, timeout_s)

    client.get_text = slow  # type: ignore[method-assign]
    for _ in range(10):
        pool.pulled(pool.handing_over(p0, decode))
        await asyncio.sleep(0)
    release.set()
    await asyncio.sleep(0.05)
    assert 1 <= len(reads) <= 2  # the one under way, and at most one that waited
