"""Dev mode's engine supervisor, on real child processes standing in for engines."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from launch.processes import EngineProcess
from launch.supervisor import Supervisor


def proc(code: str, role: str = "decode", tmp: Path = Path("/tmp")) -> EngineProcess:
    popen = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    spec = SimpleNamespace(role=role, port=1, url="http://127.0.0.1:1", cpu_cores=None)
    return EngineProcess(spec, popen, tmp / "none.log")  # type: ignore[arg-type]


RUNS = "import time; time.sleep(60)"
DIES = "raise SystemExit(3)"


def wait_dead(e: EngineProcess) -> None:
    e.popen.wait(10)


def killed_and_restarted(engines: list[EngineProcess], i: int) -> EngineProcess:
    """Kill engine ``i`` and wait (10 s at most) for the supervisor to replace it."""
    killed = engines[i]
    killed.popen.kill()
    deadline = time.monotonic() + 10
    while engines[i] is killed:
        assert time.monotonic() < deadline, f"engine {i} not restarted"
        time.sleep(0.05)
    return killed


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


def test_the_run_file_is_replaced_whole_on_a_restart(tmp_path):
    """Whoever reads run.json while a restart rewrites it gets the old file or the new one,
    never a truncated one (it used to be rewritten in place)."""
    from launch.dev import DevOptions, _write_run_file

    opts = DevOptions(model_path="/m", served_model_name="m")
    engines = [proc(RUNS, "prefill", tmp_path), proc(RUNS, "decode", tmp_path)]
    for e in engines:
        e.spec.url, e.spec.side_channel_port = "http://127.0.0.1:1", 2
    try:
        _write_run_file(tmp_path, opts, engines[:1])
        with open(tmp_path / "run.json") as reading:
            _write_run_file(tmp_path, opts, engines)
            assert len(json.loads(reading.read())["engines"]) == 1
        assert len(json.loads((tmp_path / "run.json").read_text())["engines"]) == 2
        assert [p.name for p in tmp_path.iterdir()] == ["run.json"]
    finally:
        for e in engines:
            e.popen.kill()


def crash_looping(tmp_path: Path, starts: list[float]) -> tuple[Supervisor, EngineProcess]:
    """A supervisor of one engine that died, whose every start dies at once (each start's
    time noted in ``starts``)."""
    def start(dead: EngineProcess) -> EngineProcess:
        starts.append(time.monotonic())
        e = proc(DIES)
        wait_dead(e)
        return e

    engine = proc(DIES)
    wait_dead(engine)
    return Supervisor([engine], tmp_path, start=start, quick_s=120.0, max_quick_deaths=3), engine


def test_a_crash_loop_backs_off_then_is_left_down(tmp_path):
    starts: list[float] = []
    sup, engine = crash_looping(tmp_path, starts)
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
    assert sup.restarts == 3 and not engine.alive()


def test_an_engine_that_dies_before_it_ever_served_is_a_crash_loop_however_slow(tmp_path):
    """A start-up longer than quick_s (a big model's load, SmolLM2 on a busy CPU) ending in the
    same crash each time (its KV cache does not fit) used to count as a death "long after
    start": restarted every second, forever, although it never once served."""
    starts: list[float] = []
    sup, _ = crash_looping(tmp_path, starts)
    now = time.monotonic()
    sup._watch[0].started = now - 200
    for _ in range(20):
        sup.check(0, now)  # found dead, 130 s after its start
        now += 1.01
        sup.check(0, now)  # restarted if its pause is over
        now += 130
    assert len(starts) == 3 and sup._watch[0].gave_up


def test_an_engine_that_served_and_died_long_after_start_is_restarted_at_once(tmp_path):
    engines = [proc(RUNS)]
    sup = Supervisor(engines, tmp_path, start=lambda d: proc(RUNS), quick_s=120.0)
    engines[0].healthy = lambda: True  # type: ignore[method-assign]
    now = time.monotonic()
    sup.check(0, now)  # alive and answering
    engines[0].popen.kill()
    wait_dead(engines[0])
    for _ in range(3):  # each time it served, then died long after
        sup.check(0, now + 200)
        sup.check(0, now + 201.01)
        assert engines[0].alive() and sup._watch[0].quick_deaths == 1
        engines[0].healthy = lambda: True  # type: ignore[method-assign]
        sup.check(0, now + 202)
        engines[0].popen.kill()
        wait_dead(engines[0])
        now += 300
    assert sup.restarts == 3 and not sup._watch[0].gave_up
    engines[0].popen.kill()


def test_a_failed_restart_is_retried_and_the_watch_goes_on(tmp_path):
    """Starting an engine can raise (fork's EAGAIN, its log dir gone): that used to end the
    supervisor's thread, silently, and no engine was ever restarted again."""
    calls = []

    def start(dead: EngineProcess) -> EngineProcess:
        calls.append(dead.spec.role)
        if len(calls) == 1:
            raise OSError(11, "Resource temporarily unavailable")
        return proc(RUNS, dead.spec.role)

    engines = [proc(RUNS, "prefill"), proc(RUNS, "decode")]
    sup = Supervisor(engines, tmp_path, start=start, quick_s=0.0, poll_s=0.05).start()
    try:
        engines[0].popen.kill()
        deadline = time.monotonic() + 10
        while len(calls) < 2:  # the failed start, then its retry (2 s later: a quick death)
            assert time.monotonic() < deadline, calls
            time.sleep(0.05)
        killed = engines[1]
        killed.popen.kill()
        wait_dead(killed)
        while engines[1] is killed:
            assert time.monotonic() < deadline and sup._thread.is_alive(), calls
            time.sleep(0.05)
        assert engines[0].alive() and engines[1].alive()
        assert calls == ["prefill", "prefill", "decode"] and sup.restarts == 2
    finally:
        sup.stop()
        for e in engines:
            e.popen.kill()


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
        killed_and_restarted(engines, 0)
        assert engines[0].alive()
    finally:
        sup.stop()
        for e in engines:
            e.popen.kill()


def test_a_dead_engine_is_reported_by_its_root_cause(tmp_path):
    """The exception that killed it, not the warning it printed while shutting down."""
    from launch.engines import EngineSpec
    from launch.processes import EngineProcess

    log = tmp_path / "decode.log"
    log.write_text(
        "INFO 12-01 starting\n"
        "(EngineCore_DP0 pid=42) Traceback (most recent call last):\n"
        '(EngineCore_DP0 pid=42)   File "x.py", line 1, in <module>\n'
        "(EngineCore_DP0 pid=42) ValueError: To serve at least one request with the model's "
        "max seq len (4096), 1.5 GiB KV cache is needed, which is larger than the available "
        "KV cache memory (0.1 GiB).\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
        "  warnings.warn('resource_tracker: There appear to be 1 leaked semaphore objects')\n")
    proc = EngineProcess(EngineSpec("decode", "m", "m", 1, 2), None, log)  # type: ignore[arg-type]
    assert proc.root_cause().startswith("ValueError: To serve at least one request")
    log.write_text("INFO starting\nKeyError: 'x'\n  warnings.warn('bye')\n")
    assert proc.root_cause() == "KeyError: 'x'"
    log.write_text("INFO starting\nINFO stopping\n")
    assert proc.root_cause() == "INFO stopping"


def test_a_restarted_engine_is_reported_by_its_own_run_not_the_one_before(tmp_path,
                                                                         monkeypatch):
    """The log is appended to on a restart: a second death with no exception (the OOM
    killer, SIGKILL) was reported with the first run's exception."""
    import launch.processes as processes
    from launch.engines import EngineSpec

    spec = EngineSpec("decode", "m", "m", 1, 2)
    log = tmp_path / "decode-1.log"
    log.write_text("INFO starting\nValueError: the KV cache does not fit\n")
    first = EngineProcess(spec, None, log)  # type: ignore[arg-type]
    assert first.root_cause() == "ValueError: the KV cache does not fit"
    monkeypatch.setattr(processes, "engine_argv", lambda spec: [
        sys.executable, "-c", "print('INFO starting'); print('INFO serving')"])
    again = processes.start_engine(spec, tmp_path, append_log=True)
    again.popen.wait(30)
    assert "ValueError" in log.read_text()
    assert again.root_cause() == again.last_log_line() == "INFO serving"


@pytest.mark.parametrize(("blocks", "gib", "ok"), [(24, 1, False), (32, 1, True), (None, 1, True)])
def test_a_kv_cache_too_small_for_one_request_is_refused_before_start(blocks, gib, ok):
    from launch.engines import check_kv_capacity

    if ok:
        check_kv_capacity("cpu", 4096, blocks, gib, 47104)
    else:
        with pytest.raises(ValueError, match="at least 32 blocks"):
            check_kv_capacity("cpu", 4096, blocks, gib, 47104)


def test_a_kv_cache_of_too_few_gib_is_refused_before_start():
    from launch.engines import check_kv_capacity

    with pytest.raises(ValueError, match="--kv-cache-gib 1 holds"):
        check_kv_capacity("cpu", 32768, None, 1, 47104)  # 1 GiB: ~22.8k SmolLM2 tokens


def test_pdserve_dev_refuses_a_kv_cache_too_small_before_starting_engines(tmp_path):
    """Tried as a new user would: `pdserve dev --kv-blocks 24` used to wait a minute, then
    print an engine's last log line; now it names the cause at once, no engine started."""
    import subprocess
    import sys
    import time

    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "launch.cli", "dev", "--model", "tiny",
                        "--kv-blocks", "24", "--port", "18990", "--engine-base-port", "18991",
                        "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--kv-blocks 24 holds 3072 tokens" in r.stderr and "at least 32 blocks" in r.stderr
    assert not (tmp_path / "run.json").exists()  # nothing was started
    assert time.monotonic() - t0 < 60


SERVES_HEALTH = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_an_engine_alive_but_hung_is_killed_after_the_hang_timeout_and_restarted(tmp_path):
    """An engine that answers /health, then is stopped (SIGSTOP: alive, answering nothing),
    is killed once three checks in a row spanning more than the timeout went unanswered, not
    before, and then restarted like an engine that died. Without hang detection it would be
    left as it is: alive, so never restarted."""
    import os
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    popen = subprocess.Popen([sys.executable, "-c", SERVES_HEALTH, str(port)],
                             start_new_session=True)
    spec = SimpleNamespace(role="decode", port=port, url=f"http://127.0.0.1:{port}",
                           cpu_cores=None)
    hung = EngineProcess(spec, popen, tmp_path / "none.log")  # type: ignore[arg-type]
    started: list[EngineProcess] = []

    def start(dead: EngineProcess) -> EngineProcess:
        started.append(proc(RUNS, dead.spec.role))
        return started[-1]

    engines = [hung]
    sup = Supervisor(engines, tmp_path, start=start, quick_s=0.0, hang_timeout_s=1.0)
    try:
        t = time.monotonic()
        deadline = t + 10
        while not sup._watch[0].ready:  # it answers: ready
            assert time.monotonic() < deadline, "the stand-in never answered /health"
            time.sleep(0.1)
            sup.check(0, t)
        os.kill(popen.pid, signal.SIGSTOP)
        for at in (t + 1.0, t + 1.5):  # two unanswered checks, 0.5 s apart: not yet
            sup.check(0, at)
            assert hung.alive()
        sup.check(0, t + 2.1)  # the third, 1.1 s after the first: hung
        assert not hung.alive() and hung.popen.returncode == -signal.SIGKILL
        sup.check(0, t + 2.2)  # found dead: restarted after its pause
        sup.check(0, t + 4.0)
        assert len(started) == 1 and engines[0] is started[0] and sup.restarts == 1
    finally:
        for e in (hung, *started):
            e.popen.kill()


def test_the_engine_whose_core_the_proxy_found_hung_is_killed_and_restarted(tmp_path):
    """The proxy's restarter (its core hung behind a live /health: ``proxy/stalls.py``) kills
    the engine serving that url, and the supervisor restarts it like one that died; another
    url kills nothing."""
    import asyncio
    import signal

    started: list[EngineProcess] = []

    def start(dead: EngineProcess) -> EngineProcess:
        started.append(proc(RUNS, dead.spec.role))
        return started[-1]

    engines = [proc(RUNS, "prefill"), proc(RUNS, "decode")]
    engines[0].spec.port, engines[0].spec.url = 8100, "http://127.0.0.1:8100"
    engines[1].spec.port, engines[1].spec.url = 8101, "http://127.0.0.1:8101"
    sup = Supervisor(engines, tmp_path, start=start, quick_s=0.0)
    hung = engines[1]
    try:
        asyncio.run(sup.restart("decode-0", "http://127.0.0.1:9999"))
        assert engines[0].alive() and hung.alive()
        asyncio.run(sup.restart("decode-0", "http://127.0.0.1:8101"))
        assert engines[0].alive() and not hung.alive()
        assert hung.popen.returncode in (-signal.SIGTERM, -signal.SIGKILL)
        t = time.monotonic()
        sup.check(1, t)  # found dead: restarted after its pause
        sup.check(1, t + 1.01)
        assert len(started) == 1 and engines[1] is started[0] and sup.restarts == 1
    finally:
        for e in (*engines, hung, *started):
            e.popen.kill()


def test_an_engine_whose_check_hangs_holds_up_no_other_engine_s_watch(tmp_path):
    """engine 0's /health check does not return (a hung engine waited out, up to 5 s a check);
    engine 1 dies meanwhile and is restarted all the same. One thread checked them in turn
    before, and engine 1's death waited for engine 0's check (checked: this test fails so)."""
    answer = threading.Event()
    checking = threading.Event()
    stuck = proc(RUNS, "prefill")

    def hangs(timeout_s: float = 1.0) -> bool:
        checking.set()
        answer.wait(30)
        return True

    stuck.healthy = hangs  # type: ignore[method-assign]
    engines = [stuck, proc(RUNS, "decode")]
    sup = Supervisor(engines, tmp_path, start=lambda d: proc(RUNS, d.spec.role), quick_s=0.0,
                     poll_s=0.05).start()
    try:
        assert checking.wait(10)
        killed = killed_and_restarted(engines, 1)
        assert engines[1].alive() and not answer.is_set()  # (0's check still waiting)
    finally:
        answer.set()
        sup.stop()
        for e in (*engines, killed):
            e.popen.kill()
