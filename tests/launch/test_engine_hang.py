"""A live engine that stopped answering is killed so Ray restarts it: the pure rule
(``launch/engine_hang.py``) and the actor's watchdog wired to it, over a fake engine process."""

from __future__ import annotations

import logging
import signal
import threading

import pytest

import launch.ray_engine as ray_engine
from launch.engine_hang import HangDetector


@pytest.mark.parametrize(("checks", "hung_at"), [
    # (answered, started at s): three failures in a row spanning more than 60 s
    ([(False, 0), (False, 30), (False, 61)], 2),
    ([(False, 0), (False, 30), (False, 60)], None),  # not more than the timeout
    ([(False, 0), (False, 61)], None),  # two failures only, however long
    ([(False, 0), (False, 5), (False, 10), (False, 15), (False, 61)], 4),
    # an answer starts the count again
    ([(False, 0), (False, 30), (True, 50), (False, 55), (False, 90), (False, 116)], 5),
    ([(False, 0), (False, 30), (True, 50), (False, 55), (False, 90), (False, 115)], None),
    ([(True, 0), (True, 100), (True, 200)], None),
])
def test_when_an_engine_is_hung(checks, hung_at):
    detector = HangDetector(timeout_s=60.0)
    verdicts = [detector.observe(answered, at_s) for answered, at_s in checks]
    assert verdicts == [i == hung_at for i in range(len(checks))]


def test_checks_are_spread_over_the_timeout_each_with_a_deadline():
    assert (HangDetector(60.0).interval_s, HangDetector(60.0).check_timeout_s) == (5.0, 5.0)
    assert (HangDetector(3.0).interval_s, HangDetector(3.0).check_timeout_s) == (0.5, 1.0)
    assert HangDetector(0.5).interval_s == 0.25


def test_poll_checks_when_due_and_finds_an_engine_hung_once():
    """The watchdogs' one entry (Ray's actor and dev mode's supervisor): a check each
    ``interval_s`` with its deadline, True the first time only."""
    detector = HangDetector(timeout_s=3.0)  # a check each 0.5 s, each within 1 s
    asked: list[tuple[float, float]] = []

    def silent(timeout_s: float) -> bool:
        asked.append((now, timeout_s))
        return False

    verdicts = []
    for tick in range(0, 60):
        now = tick * 0.1
        verdicts.append(detector.poll(silent, now))
    assert [at for at, _ in asked] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5])
    assert {timeout for _, timeout in asked} == {1.0}
    assert verdicts.count(True) == 1 and verdicts.index(True) == 35  # 3.5 - 0.0 > 3 s
    assert "unanswered for 4 s (8 checks in a row)" in detector.why(4.0)


class _Popen:
    pid = 4242

    def __init__(self):
        self.returncode: int | None = None

    def poll(self):
        return self.returncode


class _Engine:
    """An engine process that answers /health ``answers`` times, then hangs (alive, silent)
    until it is SIGKILLed."""

    def __init__(self, answers: int):
        self.popen = _Popen()
        self.answers = answers
        self.check_timeouts: list[float] = []

    def healthy(self, timeout_s: float = 1.0) -> bool:
        self.check_timeouts.append(timeout_s)
        self.answers -= 1
        return self.answers >= 0


class _Exited(Exception):
    pass


def _host(monkeypatch, engine: _Engine, hang_timeout_s: float):
    """An EngineHost around ``engine`` (no actor, no Ray); SIGKILL ends ``engine``, the
    actor's exit raises :class:`_Exited`."""
    killed: list[tuple[int, int]] = []

    def killpg(pid: int, sig: int) -> None:
        killed.append((pid, sig))
        engine.popen.returncode = -sig

    def exit_actor(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(ray_engine, "WATCH_TICK_S", 0.01)
    monkeypatch.setattr(ray_engine.os, "killpg", killpg)
    monkeypatch.setattr(ray_engine.os, "_exit", exit_actor)
    monkeypatch.setattr(ray_engine, "guard", lambda engines, report: 0)
    host = object.__new__(ray_engine.EngineHost)
    host.name, host.proc, host.failed = "decode-0", engine, None
    host.spec = type("Spec", (), {"cpu_cores": None})()
    host._stopping = threading.Event()
    host._hang = HangDetector(hang_timeout_s) if hang_timeout_s > 0 else None
    return host, killed


def test_a_ready_engine_that_stops_answering_is_killed_and_the_actor_exits(monkeypatch,
                                                                           caplog):
    engine = _Engine(answers=3)  # ready, answers twice more, then hangs
    host, killed = _host(monkeypatch, engine, hang_timeout_s=0.3)
    stop = threading.Timer(10.0, host._stopping.set)  # (a watchdog that never acts ends)
    stop.start()
    with caplog.at_level(logging.ERROR, "launch.ray_engine"), pytest.raises(_Exited) as exited:
        host._watch()
    stop.cancel()
    assert exited.value.args == (1,)  # Ray restarts the actor, and with it the engine
    assert killed[0] == (_Popen.pid, signal.SIGKILL)  # the process group, as on exit
    assert engine.check_timeouts[1:] == [1.0] * (len(engine.check_timeouts) - 1)
    assert any("/health unanswered" in m for m in caplog.messages), caplog.messages
    assert host.failed is None


def test_without_a_hang_timeout_a_silent_engine_is_left_alone(monkeypatch):
    engine = _Engine(answers=1)
    host, killed = _host(monkeypatch, engine, hang_timeout_s=0)
    threading.Timer(0.5, host._stopping.set).start()
    host._watch()
    assert killed == [] and engine.check_timeouts == [1.0]  # the readiness check only
