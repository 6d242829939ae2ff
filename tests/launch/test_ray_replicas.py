"""Ray mode keeps its declared engines: the pure plan (``launch/replica_plan.py``, table-driven)
and the scaler doing it (``RayScaler.reconcile``) over fake actors, no cluster."""

from __future__ import annotations

import asyncio
import logging

import pytest

from launch.replica_plan import Plan, Replica, ReplicaRule, Strikes, judge, plan_replicas
from launch.settings import EngineSettings
from tests.launch.ray_fakes import FakeActorClass

RULE = ReplicaRule(first_pause_s=10.0, max_pause_s=40.0, max_strikes=3, ready_within_s=300.0)
READY = {"failed": None, "healthy": True}
STARTING = {"failed": None, "healthy": False}
FAILED = {"failed": "engine exited with 1 before it was ready: 'OOM'", "healthy": False}


def r(name: str, state: str, replacement: bool = False) -> Replica:
    return Replica(name, name.rsplit("-", 1)[0], state, replacement)  # type: ignore[arg-type]


@pytest.mark.parametrize(("declared", "replicas", "strikes", "now_s", "want"), [
    # at its size: nothing to do
    ({"decode": 2}, [r("decode-0", "ready"), r("decode-1", "ready")], {}, 0.0,
     Plan(strikes={"decode": Strikes()})),
    # a starting (or restarting) engine may serve: not replaced
    ({"decode": 2}, [r("decode-0", "ready"), r("decode-1", "starting")], {}, 0.0,
     Plan(strikes={"decode": Strikes()})),
    # an engine that had served, dead for good: stopped, and one started at once
    ({"decode": 2}, [r("decode-0", "ready"), r("decode-1", "dead")], {}, 0.0,
     Plan(stop=("decode-1",), start={"decode": 1}, strikes={"decode": Strikes()})),
    # a replacement dead before it was ever ready: a strike; the next waits its pause
    ({"decode": 1}, [r("decode-2", "dead", replacement=True)], {}, 100.0,
     Plan(stop=("decode-2",), strikes={"decode": Strikes(1, 100.0)})),
    ({"decode": 1}, [], {"decode": Strikes(1, 100.0)}, 109.0,
     Plan(strikes={"decode": Strikes(1, 100.0)})),
    ({"decode": 1}, [], {"decode": Strikes(1, 100.0)}, 110.0,
     Plan(start={"decode": 1}, strikes={"decode": Strikes(1, 100.0)})),
    # the pause doubles, up to its cap
    ({"decode": 1}, [], {"decode": Strikes(2, 100.0)}, 119.0,
     Plan(strikes={"decode": Strikes(2, 100.0)})),
    ({"decode": 1}, [], {"decode": Strikes(2, 100.0)}, 120.0,
     Plan(start={"decode": 1}, strikes={"decode": Strikes(2, 100.0)})),
    # the last strike allowed: given up (said once), the dead one still stopped
    ({"decode": 1}, [r("decode-4", "dead", replacement=True)], {"decode": Strikes(2, 100.0)},
     200.0, Plan(stop=("decode-4",), strikes={"decode": Strikes(3, 200.0)},
                 gave_up=("decode",))),
    ({"decode": 1}, [], {"decode": Strikes(3, 200.0)}, 9999.0,
     Plan(strikes={"decode": Strikes(3, 200.0)})),
    # a replacement seen ready clears its role's strikes: the next dead one is replaced at once
    ({"decode": 2}, [r("decode-3", "ready", replacement=True), r("decode-1", "dead")],
     {"decode": Strikes(2, 100.0)}, 101.0,
     Plan(stop=("decode-1",), start={"decode": 1}, strikes={"decode": Strikes()})),
    # roles apart; a role not declared (a scale order's own look) has strikes and no start
    ({}, [r("prefill-0", "dead", replacement=True), r("decode-0", "dead")], {}, 5.0,
     Plan(stop=("prefill-0", "decode-0"), strikes={"decode": Strikes(),
                                                    "prefill": Strikes(1, 5.0)})),
    # more live engines than declared: none removed (scaling down drains first)
    ({"decode": 1}, [r("decode-0", "ready"), r("decode-1", "ready")], {}, 0.0,
     Plan(strikes={"decode": Strikes()})),
])
def test_the_plan(declared, replicas, strikes, now_s, want):
    assert plan_replicas(declared, replicas, strikes, now_s, RULE) == want


@pytest.mark.parametrize(("state", "unready_s", "judged"), [
    ("starting", 300.0, "starting"),  # within the start timeout: may still come up
    ("starting", 300.5, "dead"),  # stuck: taken as dead for good
    ("ready", 10_000.0, "ready"),  # (a ready engine has no such clock; never judged)
    ("dead", 0.0, "dead"),
])
def test_an_engine_starting_longer_than_the_start_timeout_is_dead(state, unready_s, judged):
    replica = Replica("decode-1", "decode", state, True, None, unready_s)
    assert judge(replica, RULE).state == judged
    if state == "starting" and judged == "dead":
        assert "stuck starting" in (judge(replica, RULE).cause or "")


def test_pauses_double_up_to_their_cap():
    assert [RULE.pause_s(n) for n in range(5)] == [0.0, 10.0, 20.0, 40.0, 40.0]


@pytest.fixture
def scaler(monkeypatch):
    import ray

    from launch.ray_actors import RayScaler
    from launch.ray_engine import EngineTemplate

    cls = FakeActorClass(STARTING)
    killed: list = []
    clock = [1000.0]
    monkeypatch.setattr(ray, "kill", lambda h, no_restart=True: killed.append(h))
    monkeypatch.setattr("launch.ray_actors.engine_host_class", lambda max_restarts: cls)
    monkeypatch.setattr("launch.ray_actors.time.monotonic", lambda: clock[0])
    template = EngineTemplate(model="tiny", served_model_name="t",
                              engines=EngineSettings(kv_cache_gib=1))
    s = RayScaler("pdserve", template, "cpu", -1, {"decode": ("pd_a", "pd_b")}, RULE)
    s.cls, s.killed, s.clock = cls, killed, clock  # type: ignore[attr-defined]
    return s


def test_a_failed_restart_is_logged_stopped_and_replaced_on_its_resource(scaler, caplog):
    """decode-1's actor was restarted by Ray and its engine failed before it was ready: it is
    stopped with its cause at error level, and decode-2 starts on decode-1's placement
    resource (pd_b)."""
    scaler.create("decode", 2)
    scaler.handles["decode-0"].answer = READY
    scaler.handles["decode-1"].answer = FAILED
    failed = scaler.handles["decode-1"]
    with caplog.at_level(logging.ERROR, "launch.ray_actors"):
        assert asyncio.run(scaler.reconcile({"decode": 2})) == {"decode": ["decode-2"]}
    assert failed.stopped and scaler.killed == [failed]
    assert sorted(scaler.handles) == ["decode-0", "decode-2"]
    assert scaler.cls.asked["decode-2"] == scaler.cls.asked["decode-1"] == {"pd_b": 0.01}
    assert any("decode-1 is dead for good" in m and "OOM" in m for m in caplog.messages)


def test_an_actor_out_of_restarts_is_replaced_once_its_death_is_final(scaler):
    from ray.exceptions import ActorDiedError

    scaler.create("decode", 1)
    scaler.handles["decode-0"].answer = ActorDiedError()
    assert asyncio.run(scaler.reconcile({"decode": 1})) == {}  # may be Ray restarting it
    assert asyncio.run(scaler.reconcile({"decode": 1})) == {"decode": ["decode-1"]}
    assert list(scaler.handles) == ["decode-1"]


def test_a_crash_loop_is_paused_then_given_up_loudly_until_a_scale_order(scaler, caplog):
    """Every replacement fails before it is ready: the pauses grow, after the third strike
    none is started (said at error level, once); ``pdserve scale`` starts one again."""
    scaler.create("decode", 1)
    scaler.handles["decode-0"].answer = FAILED
    scaler.cls.answer = FAILED  # every replacement fails too
    started = []
    with caplog.at_level(logging.ERROR, "launch.ray_actors"):
        for _ in range(80):  # 80 s of reconcile rounds, a second apart
            started += [n for ns in asyncio.run(scaler.reconcile({"decode": 1})).values()
                        for n in ns]
            scaler.clock[0] += 1.0
    # decode-0 (had served) replaced at once; decode-1 and decode-2 died: paused 10 s, 20 s;
    # decode-3's death was the third strike.
    assert started == ["decode-1", "decode-2", "decode-3"]
    assert scaler.handles == {}
    gave_up = [m for m in caplog.messages if "no more are started" in m]
    assert len(gave_up) == 1 and "3 replacement engines in a row" in gave_up[0], caplog.messages
    assert asyncio.run(scaler.add("decode", 1)) == ["decode-4"]
    scaler.cls.answer = READY
    scaler.handles["decode-4"].answer = READY
    assert asyncio.run(scaler.reconcile({"decode": 1})) == {}
    assert scaler._strikes["decode"] == Strikes()


def test_a_replacement_seen_ready_clears_the_strikes(scaler):
    scaler.create("decode", 1)
    scaler.handles["decode-0"].answer = FAILED
    scaler.cls.answer = FAILED
    asyncio.run(scaler.reconcile({"decode": 1}))  # decode-1 in its place
    asyncio.run(scaler.reconcile({"decode": 1}))  # decode-1 failed: strike 1
    assert scaler._strikes["decode"].count == 1
    scaler.clock[0] += RULE.pause_s(1)
    scaler.cls.answer = READY
    assert asyncio.run(scaler.reconcile({"decode": 1})) == {"decode": ["decode-2"]}
    asyncio.run(scaler.reconcile({"decode": 1}))
    assert scaler._strikes["decode"] == Strikes()


def test_a_dead_engine_seen_by_a_scale_order_still_counts_as_a_strike(scaler):
    scaler.create("decode", 1)
    scaler.handles["decode-0"].answer = FAILED
    scaler.cls.answer = FAILED
    asyncio.run(scaler.reconcile({"decode": 1}))
    assert asyncio.run(scaler.replicas("decode")) == []  # decode-1 failed: stopped
    assert scaler._strikes["decode"].count == 1


def test_a_replacement_stuck_starting_is_stopped_and_counted_as_a_strike(scaler, caplog):
    """decode-1 replaces decode-0 and never becomes ready nor fails (its load hangs): past
    the start timeout it is stopped, named as stuck, a strike, and another takes its place
    after the pause. An engine that had served and is restarting past the timeout (decode-2
    here, seen ready once) is replaced too, but is no strike."""
    scaler.create("decode", 1)
    scaler.handles["decode-0"].answer = FAILED
    assert asyncio.run(scaler.reconcile({"decode": 1})) == {"decode": ["decode-1"]}
    stuck = scaler.handles["decode-1"]  # starting, and stays so
    scaler.clock[0] += RULE.ready_within_s
    assert asyncio.run(scaler.reconcile({"decode": 1})) == {}  # not past it yet
    scaler.clock[0] += 1.0
    with caplog.at_level(logging.ERROR, "launch.ray_actors"):
        assert asyncio.run(scaler.reconcile({"decode": 1})) == {}  # stopped; pause first
    assert stuck.stopped and scaler.killed[-1] is stuck and scaler.handles == {}
    assert scaler._strikes["decode"].count == 1
    assert any("decode-1 is dead for good" in m and "stuck starting" in m
               for m in caplog.messages), caplog.messages
    scaler.clock[0] += RULE.pause_s(1)
    scaler.cls.answer = READY
    assert asyncio.run(scaler.reconcile({"decode": 1})) == {"decode": ["decode-2"]}
    asyncio.run(scaler.reconcile({"decode": 1}))  # seen ready: strikes cleared
    scaler.handles["decode-2"].answer = STARTING  # restarting, and stuck there
    scaler.clock[0] += RULE.ready_within_s + 1.0
    assert asyncio.run(scaler.reconcile({"decode": 1})) == {"decode": ["decode-3"]}
    assert scaler._strikes["decode"] == Strikes()


def test_ray_calls_to_create_and_kill_actors_leave_the_event_loop_free(scaler):
    """Creating a named actor and killing one block on Ray's GCS (a minute with it gone): the
    proxy's loop keeps serving meanwhile. Here each call blocks until the loop itself lets it
    go; run on the loop, it would wait out its 5 s and say so (checked: both calls on the loop
    fail this test)."""
    import threading

    import ray

    gates = {what: (threading.Event(), threading.Event()) for what in ("kill", "create")}
    waited_out: list[str] = []

    def blocking(what, result):
        entered, released = gates[what]

        def call(*args, **kwargs):
            entered.set()
            if not released.wait(5.0):
                waited_out.append(what)
            return result(*args, **kwargs)
        return call

    scaler.create("decode", 1)
    scaler.handles["decode-0"].answer = FAILED
    scaler._spawn = blocking("create", scaler._spawn)
    ray.kill = blocking("kill", ray.kill)  # (the fixture's fake, restored by its monkeypatch)

    async def main():
        settling = asyncio.create_task(scaler.reconcile({"decode": 1}))
        for what in ("kill", "create"):  # decode-0 stopped, then decode-1 started
            entered, released = gates[what]
            while not entered.is_set():  # (the fixture's clock stands still: no timed sleep)
                await asyncio.sleep(0)
            released.set()  # by the loop, while Ray's call waits
        return await settling

    assert asyncio.run(main()) == {"decode": ["decode-1"]}
    assert waited_out == [] and len(scaler.killed) == 1


def test_the_proxy_restarts_an_engine_whose_core_hung_by_killing_its_actor_for_ray_to_restart(
        scaler, monkeypatch):
    import ray

    kills: list[tuple[object, bool]] = []
    monkeypatch.setattr(ray, "kill", lambda h, no_restart=True: kills.append((h, no_restart)))
    scaler.create("decode", 2)
    asyncio.run(scaler.restart("decode-1", "http://10.0.0.2:8101"))
    assert kills == [(scaler.handles["decode-1"], False)]  # Ray restarts it: a fresh engine
    asyncio.run(scaler.restart("decode-7", "http://10.0.0.2:8107"))  # not one of ours
    assert len(kills) == 1 and sorted(scaler.handles) == ["decode-0", "decode-1"]
