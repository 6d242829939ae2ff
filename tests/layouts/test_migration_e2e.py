"""Stream migration on real engines: the aggregated pool's two vLLM engines each decoding some of
8 concurrent greedy streams (the official ``openai`` client), one engine SIGKILLed mid-stream
(the whole engine, or only its engine core);
every stream completes, its text equal to the same stream's uninterrupted run (a migrated
stream may differ after the switch: ``harness.greedy_streams``), and the proxy counts the
migrations. The killed engine is restarted by dev mode's supervisor, and so is the frozen one,
killed first by the supervisor as hung (``--hang-timeout-s``). An engine core frozen alone
behind its live API server is routed around by the proxy, which has the supervisor restart
it after the same timeout. Each test starts by waiting
until the proxy sees both engines healthy (the one killed before it may still be restarting);
the package runs these tests last (``conftest.py``), so no other test waits for a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import httpx
import psutil
import pytest

from harness.engine_io import proxy_metric
from harness.greedy_streams import differing, greedy_streams, not_one_stream
from harness.prompts import text_of_tokens
from harness.routes import costs, wait_for
from tests.layouts.conftest import HANG_TIMEOUT_S, IDLE_DEADLINE_S
from tests.layouts.test_layouts import route

STREAMS = 8
MAX_TOKENS = 192
VICTIM = "engine-0"


@pytest.mark.parametrize("kill", ["stall", "core_frozen", "engine_core", "engine"])
def test_streams_of_a_killed_engine_continue_on_the_other_with_the_same_text(pool_stack, kill):
    """``engine``: the whole engine SIGKILLed (its connections drop); ``engine_core``: only its
    vLLM engine core (an out-of-memory kill or a device fault does this), whose API server
    then ends each stream with an in-band error event (code 500) and ``[DONE]``; ``stall``: the
    whole engine SIGSTOPped (a hung host: its kernel still accepts connections, nothing
    answers). The proxy marks a stalled engine down after three slow health probes and cuts
    its streams then, so they continue on the other engine well before the idle deadline
    (25 s here) would have noticed. It stays frozen: the supervisor kills it as hung once its
    /health went unanswered past ``--hang-timeout-s`` (not before), and restarts it.
    ``core_frozen``: only its engine core SIGSTOPped; its API server answers /health (vLLM asks
    only whether its engine client has errored), so neither probes nor the supervisor's hang
    check see it. Its streams stall past the idle deadline and continue on the other engine;
    after two stalls its probe asks for a token, none comes within 10 s, and it is marked down
    (``proxy/stalls.py``): new requests go to the other engine although its /health answers.
    Down so for ``--hang-timeout-s``, the supervisor kills it at the proxy's word and restarts
    it."""
    stack = pool_stack
    # A frozen core's streams stall (the first ones), or are cut when it is marked down (lost).
    reasons = {"engine_core": ("decode_error",),
               "core_frozen": ("decode_timeout", "decode_lost")}.get(kill, ("decode_lost",))
    stopped: list[int] = []  # process groups SIGSTOPped
    cores: list[psutil.Process] = []  # engine cores SIGSTOPped
    frozen: list[tuple[psutil.Process, float]] = []  # the group's leader, when
    wait_for(lambda: all(e["healthy"] for e in costs(stack)["engines"].values()),
             "both engines healthy (one killed before may be restarting)", timeout_s=240)
    route(stack, policy="auto", prefill=[], decode=["engine-0", "engine-1"])
    prompts = [text_of_tokens(40, seed=300 + i) for i in range(STREAMS)]

    def run(kill=None):
        return asyncio.run(greedy_streams(stack.proxy_url, stack.model_name, prompts,
                                          MAX_TOKENS, kill=kill))

    def kill_victim() -> None:
        url = costs(stack)["engines"][VICTIM]["url"]
        (pgid,) = [e["pid"] for e in stack.run_info()["engines"] if e["url"] == url]
        if kill == "engine":
            os.killpg(pgid, signal.SIGKILL)
            return
        if kill == "stall":
            os.killpg(pgid, signal.SIGSTOP)
            stopped.append(pgid)
            frozen.append((psutil.Process(pgid), time.monotonic()))
            return
        (core,) = [p for p in psutil.Process(pgid).children(recursive=True)  # (under the
                   if p.name().startswith("VLLM::EngineCor")]  # reaper that leads the group)
        if kill == "core_frozen":
            core.suspend()
            cores.append(core)
            return
        core.kill()

    reference = run()
    assert all(r.finish == "length" for r in reference)
    before = migrations(stack, reasons)
    route(stack, policy="auto", prefill=[], decode=["engine-0", "engine-1"])  # idle again
    try:
        killed = run(kill_victim)
        migrated = migrations(stack, reasons) - before
        gaps = sorted(round(max(r.gaps()), 3) for r in killed)
        print(f"migrated {migrated:.0f} of {STREAMS} streams; longest gap per stream (s): {gaps}")
        assert migrated >= 1, "no stream was on the killed engine"
        assert [r.finish for r in killed] == ["length"] * STREAMS
        # One stream each, as a client sees it: one id, one finish, usage counting the
        # prompt once and every token once (the uninterrupted run's).
        assert all(r.one_stream() for r in reference)
        assert not_one_stream(reference, killed) == []
        differ = differing(reference, killed)
        print(f"texts equal to the uninterrupted run's: {STREAMS - len(differ)} of {STREAMS}")
        assert len(differ) <= migrated, differ  # only a migrated one may differ (see differing)
        if kill == "stall":  # cut at the mark-down (~9 s), not at the idle deadline
            assert max(gaps) < IDLE_DEADLINE_S - 5, gaps
            killed_after = hung_engine_killed(*frozen[0])
            print(f"the frozen engine killed as hung {killed_after:.1f}s after it froze")
            wait_for(lambda: costs(stack)["engines"][VICTIM]["healthy"],
                     "the engine killed as hung restarted", timeout_s=240)
        if kill == "core_frozen":
            routed_around_then_restarted(stack, cores[0])
    finally:
        for core in cores:
            with contextlib.suppress(psutil.NoSuchProcess):
                core.resume()
        for pgid in stopped:
            with contextlib.suppress(ProcessLookupError):  # (killed as hung)
                os.killpg(pgid, signal.SIGCONT)


def migrations(stack, reasons: tuple[str, ...]) -> float:
    return sum(proxy_metric(stack.proxy_url, "pd_migrations_total", reason=r) for r in reasons)


def routed_around_then_restarted(stack, core: psutil.Process) -> None:
    """The victim's core is frozen: the proxy has it down while its /health answers 200, and
    new streams all complete on the other engine (none stalls: no new migration). Down that
    way for ``--hang-timeout-s``, it is killed by dev mode's supervisor at the proxy's word
    (not before), and restarted: a new process, up again."""
    url = costs(stack)["engines"][VICTIM]["url"]
    wait_for(lambda: not costs(stack)["engines"][VICTIM]["healthy"],
             "marked down: no token from its probe", timeout_s=30)
    down_at = time.monotonic()
    shown = costs(stack)["engines"][VICTIM]
    assert shown["silent"] and shown["stalls"] >= 2, shown
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    (pid,) = [e["pid"] for e in stack.run_info()["engines"] if e["url"] == url]
    stalled_or_cut = ("decode_timeout", "decode_lost")
    before = migrations(stack, stalled_or_cut)
    prompts = [text_of_tokens(20, seed=400 + i) for i in range(4)]
    after = asyncio.run(greedy_streams(stack.proxy_url, stack.model_name, prompts, 16))
    assert [r.finish for r in after] == ["length"] * len(prompts)
    assert migrations(stack, stalled_or_cut) == before
    while core.is_running() and core.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() - down_at < HANG_TIMEOUT_S + 30, "the hung core was not killed"
        time.sleep(0.5)
    killed_after = time.monotonic() - down_at
    print(f"the engine with the hung core killed {killed_after:.1f}s after it was marked down")
    assert killed_after > HANG_TIMEOUT_S - 1.5, killed_after  # (down_at seen up to 1 s late)
    wait_for(lambda: costs(stack)["engines"][VICTIM]["healthy"],
             "the engine whose core hung restarted and up", timeout_s=240)
    (restarted,) = [e["pid"] for e in stack.run_info()["engines"] if e["url"] == url]
    assert restarted != pid


def hung_engine_killed(leader: psutil.Process, since: float) -> float:
    """Wait until the frozen engine's group ``leader`` is gone, killed by the supervisor; not
    before ``--hang-timeout-s``. Seconds from ``since`` (when it froze)."""
    while leader.is_running() and leader.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() - since < HANG_TIMEOUT_S + 60, "the hung engine was not killed"
        time.sleep(0.5)
    killed_after = time.monotonic() - since
    assert killed_after > HANG_TIMEOUT_S, killed_after
    return killed_after
