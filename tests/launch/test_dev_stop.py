"""Dev mode's engines never outlive it: ``launch.dev.run_dev`` in a child process, with engines
that are plain sleepers (one ignores SIGTERM, like an engine stuck in its shutdown) and an
observer whose stop takes a while (Prometheus waits up to 10 s). No vLLM, no 8xxx ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

#: ``run_dev`` up to serving; the engines' pids are written to ``argv[1]`` once both run.
DEV = r"""
import json, os, sys, time
from pathlib import Path
import launch.dev as dev
import launch.processes as processes

pids = Path(sys.argv[1])
sleeper = "import signal, sys, time\n" \
          "if sys.argv[1] == 'hung': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" \
          "time.sleep(120)\n"
processes.engine_argv = lambda spec: [sys.executable, "-c", sleeper,
                                      "hung" if spec.role == "decode" else "ok"]
processes.engine_env = lambda spec: dict(os.environ)
dev.detect_device = lambda: "cpu"
dev.check_kv_capacity = lambda *a, **k: None
dev.confinement_report = lambda engines: None
dev.stop_engines = lambda engines: processes.stop_engines(engines, grace_s=1.0)

def serving(server):  # stands for uvicorn serving; SIGTERM: the launcher's sys.exit(143)
    run = json.loads((pids.parent / "logs" / "run.json").read_text())
    pids.write_text(" ".join(str(e["pid"]) for e in run["engines"]))
    time.sleep(120)

class SlowObserver:
    def __init__(self, *args, **kwargs):
        pass

    def stop(self):
        time.sleep(3)

dev.wait_ready = lambda *args, **kwargs: time.sleep(0.5)  # both sleepers set SIGTERM's fate
dev.run_server = serving
dev.Observer = SlowObserver
from launch.settings import ProxySettings
opts = dev.DevOptions(model_path="/nonexistent", served_model_name="m",
                      engine_base_port=29541, side_channel_base_port=29551,
                      kv_events_base_port=29561, log_dir=pids.parent / "logs",
                      restart_engines=False, proxy=ProxySettings(port=29571, policy="local"))
sys.exit(dev.run_dev(opts))
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_file(path: Path, proc: subprocess.Popen, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "never got that far"
        time.sleep(0.05)
    return path.read_text()


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_second_stop_signal_while_stopping_leaves_no_engine_behind(tmp_path, second):
    """SIGTERM, then another stop signal as soon as "stopping engines ..." shows (an impatient
    Ctrl-C, an init system's second SIGTERM): it used to unwind out of the cleanup, leaving
    the engines unsignalled (stuck behind the observer's stop) or the hung one never
    SIGKILLed."""
    pids = tmp_path / "pids"
    dev = subprocess.Popen([sys.executable, "-c", DEV, str(pids)], stderr=subprocess.PIPE,
                           text=True)
    engines = [int(p) for p in wait_file(pids, dev).split()]
    try:
        dev.send_signal(signal.SIGTERM)
        assert dev.stderr is not None
        for line in dev.stderr:
            if line.startswith("stopping engines"):
                break
        dev.send_signal(second)
        _, err = dev.communicate(timeout=30)
        assert dev.returncode == 143, err[-600:]
        deadline = time.monotonic() + 5
        while (left := [p for p in engines if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"engines {left} outlived pdserve dev: {err[-600:]}"
    finally:
        kill_all(engines)
        if dev.poll() is None:
            dev.kill()


#: An engine (standing in for vLLM's API server, its child for the engine core) started the way
#: dev mode restarts one: on a thread that then ends. Writes "engine child" pids to ``argv[1]``.
RESTARTED = r"""
import os, sys, threading, time
from pathlib import Path
import launch.processes as processes
from launch.engines import EngineSpec

pids = Path(sys.argv[1])
server = ("import subprocess, sys, time\n"
          "core = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
          "print(core.pid, flush=True)\n"
          "time.sleep(120)\n")
processes.engine_argv = lambda spec: [sys.executable, "-c", server]
processes.engine_env = lambda spec: dict(os.environ)
started = []
thread = threading.Thread(target=lambda: started.append(processes.start_engine(
    EngineSpec("decode", "m", "m", 29531, 29532), pids.parent)))
thread.start()
thread.join()
log = started[0].log_path
while not log.read_text().strip():
    time.sleep(0.05)
pids.write_text(f"{started[0].popen.pid} {log.read_text().split()[0]}")
time.sleep(120)
"""


def test_an_engine_dies_with_a_sigkilled_pdserve_not_with_the_thread_that_started_it(tmp_path):
    """kill -9 (or the OOM killer) of pdserve dev used to leave both engines running, holding
    their ports and cores. Now each runs under the reaper, which the kernel signals when the
    *thread* that forked it ends: so it is forked on a thread that lasts as long as the
    process, and an engine the supervisor restarted outlives the thread that asked."""
    pids = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", RESTARTED, str(pids)])
    engine, core = [int(p) for p in wait_file(pids, parent).split()]
    try:
        time.sleep(0.5)  # a parent-death signal from the thread's end would have landed
        assert alive(engine) and alive(core), "the engine died with the thread that started it"
        parent.kill()
        parent.wait(5)
        deadline = time.monotonic() + 10
        while (left := [p for p in (engine, core) if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"{left} outlived the SIGKILLed pdserve"
    finally:
        kill_all([engine, core])
        if parent.poll() is None:
            parent.kill()


def test_pdserve_dev_killed_outright_takes_its_engines_with_it(tmp_path):
    pids = tmp_path / "pids"
    dev = subprocess.Popen([sys.executable, "-c", DEV, str(pids)])
    engines = [int(p) for p in wait_file(pids, dev).split()]
    try:
        dev.kill()
        dev.wait(5)
        deadline = time.monotonic() + 20  # the hung one: its reaper's grace, then SIGKILL
        while (left := [p for p in engines if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"engines {left} outlived the SIGKILLed pdserve dev"
    finally:
        kill_all(engines)
