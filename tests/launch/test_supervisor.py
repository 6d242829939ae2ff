"""Dev mode's engine supervisor, on real child processes standing in for engines."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from launch.processes import EngineProcess
from launch.supervisor import Supervisor


def proc(code: str, role: str = "decode", tmp: Path = Path("/tmp")) -> EngineProcess:
    popen = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    return EngineProcess(SimpleNamespace(role=role, port=1), popen, tmp / "none.log")


RUNS = "import time; time.sleep(60)"
DIES = "raise SystemExit(3)"


def wait_dead(e: EngineProcess) -> None:
    e.popen.wait(10)


def test_a_dead_engine_is_restarted_in_place_and_reported(tmp_path):
    started: list[EngineProcess] = []
    written: list[list[int]] = []

    def start(dead: EngineProcess) -> EngineProcess:
        started.append(proc(RUNS, dead.spec.role))
        return started[-1]

    engines = [proc(RUNS, "prefill"), proc(DIES, "decode")]
    sup = Supervisor(engines, tmp_path, start=start, quick_s=0.0,
                     on_restart=lambda es: written.append([e.popen.pid for e in es]))
    wait_dead(engines[1])
    t = time.monotonic()
    sup.check(0, t)
    sup.check(1, t)  # found dead: a pause first (1 s after a death that was not quick)
    assert started == [] and not engines[1].alive()
    sup.check(1, t + 1.01)
    assert len(started) == 1 and engines[1] is started[0] and engines[1].alive()
    assert written == [[engines[0].popen.pid, started[0].popen.pid]] and sup.restarts == 1
    for e in engines:
        e.popen.kill()


def test_a_crash_loop_backs_off_then_is_left_down(tmp_path):
    starts = []

    def start(dead: EngineProcess) -> EngineProcess:
        starts.append(time.monotonic())
        e = proc(DIES)
        wait_dead(e)
        return e

    engines = [proc(DIES)]
    wait_dead(engines[0])
    sup = Supervisor(engines, tmp_path, start=start, quick_s=120.0, max_quick_deaths=3)
    now = time.monotonic()
    pauses = []
    for _ in range(200):
        before = len(starts)
        sup.check(0, now)
        if len(starts) > before:
            pauses.append(now)
        now += 0.25
    # Deaths 1-3 are restarted after 1, 2 and 4 s; the 4th quick death leaves it down.
    assert len(starts) == 3, starts
    gaps = [round(b - a) for a, b in zip(pauses, pauses[1:])]
    assert gaps == [2, 4], gaps  # each pause counted from the death, deaths are immediate
    assert sup.restarts == 3 and not engines[0].alive()


def test_no_restart_after_stop(tmp_path):
    engines = [proc(DIES)]
    wait_dead(engines[0])
    sup = Supervisor(engines, tmp_path, start=lambda d: proc(RUNS), quick_s=0.0).start()
    sup.stop()
    sup.check(0, time.monotonic() + 100)
    assert sup.restarts == 0 and not engines[0].alive()


def test_the_thread_restarts_a_killed_engine(tmp_path):
    engines = [proc(RUNS)]
    sup = Supervisor(engines, tmp_path, start=lambda d: proc(RUNS), quick_s=0.0,
                     poll_s=0.05).start()
    try:
        first = engines[0]
        first.popen.kill()
        deadline = time.monotonic() + 10
        while engines[0] is first:
            assert time.monotonic() < deadline, "not restarted"
            time.sleep(0.05)
        assert engines[0].alive()
    finally:
        sup.stop()
        for e in engines:
            e.popen.kill()
