"""launch/reaper.py with real processes: whatever way the command or the reaper's parent ends,
nothing the command started is left running. The command here stands in for vLLM's API server;
its child that ignores SIGTERM, for an engine core stuck in its shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from launch.engines import EngineSpec
from launch.processes import launch_argv

#: A command that starts a child ignoring SIGTERM (``setsid`` puts it out of the command's
#: session and group, so only a subreaper can still find it once the command is gone), writes
#: both pids to ``pids``, then does what ``mode`` says.
COMMAND = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    pids, mode = sys.argv[1], sys.argv[2]
    grandchild = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
         "signal.SIG_IGN); time.sleep(120)"], start_new_session=True)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(pids + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}")
    os.rename(pids + ".tmp", pids)
    if mode.startswith("exit"):
        os._exit(int(mode[4:]))  # its child orphaned, never waited for
    time.sleep(120)
""")


def reaper_under(tmp_path: Path, mode: str, *, grace_s: float = 0.5, stop_grace_s: float = 1.0,
                 parent_exits: bool = False) -> tuple[subprocess.Popen, list[int]]:
    """Start the reaper on COMMAND (through a parent that exits at once, when asked); return
    the started process and the pids [command, grandchild] once they are written."""
    pids = tmp_path / "pids"
    command = [sys.executable, "-c", COMMAND, str(pids), mode]
    reaper = (f"import sys; from launch.reaper import run; sys.exit(run({command!r}, "
              f"grace_s={grace_s}, stop_grace_s={stop_grace_s}))")
    if parent_exits:  # the parent starts the reaper the way start_engine does, then dies outright
        # It exits when its stdin closes (``parent.stdin.close()``), whatever the box's speed.
        parent = ("import subprocess, sys, os; from launch.reaper import die_with_parent; "
                  f"p = subprocess.Popen([sys.executable, '-c', {reaper!r}], "
                  "start_new_session=True, preexec_fn=lambda: die_with_parent(os.getppid())); "
                  "print(p.pid, flush=True); sys.stdin.read(); os._exit(9)")
        proc = subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    else:
        proc = subprocess.Popen([sys.executable, "-c", reaper], start_new_session=True)
    deadline = time.monotonic() + 30
    while not pids.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "command never started"
        time.sleep(0.05)
    return proc, [int(p) for p in pids.read_text().split()]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture(autouse=True)
def _no_leftovers():
    started: list[int] = []
    yield started
    for pid in started:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def test_the_command_exits_and_its_orphan_is_killed_with_its_status_kept(tmp_path,
                                                                            _no_leftovers):
    proc, pids = reaper_under(tmp_path, "exit3")
    _no_leftovers.extend(pids)
    assert proc.wait(15) == 3
    assert wait_gone(pids, 0) == [], "the command's orphan outlived the reaper"


def test_a_stop_signal_reaches_the_command_and_what_ignores_it_is_killed(tmp_path,
                                                                          _no_leftovers):
    proc, pids = reaper_under(tmp_path, "sleep")
    _no_leftovers.extend(pids)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 128 + signal.SIGTERM  # the command died of the forwarded SIGTERM
    assert wait_gone(pids, 0) == []


def test_a_command_that_ignores_the_stop_signal_is_killed_after_the_grace(tmp_path,
                                                                           _no_leftovers):
    proc, pids = reaper_under(tmp_path, "stubborn", stop_grace_s=1.0)
    _no_leftovers.extend(pids)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 128 + signal.SIGKILL
    assert 1.0 <= time.monotonic() - t0 < 10
    assert wait_gone(pids, 0) == []


def test_the_reapers_parent_killed_outright_takes_everything_with_it(tmp_path, _no_leftovers):
    """What a Ray actor's death does to its engine: the parent exits without a word, the
    reaper gets its death signal, and the command and the command's child die too."""
    parent, pids = reaper_under(tmp_path, "sleep", parent_exits=True)
    reaper_pid = int(parent.stdout.readline())
    _no_leftovers.extend([reaper_pid, *pids])
    parent.stdin.close()
    assert parent.wait(15) == 9
    assert wait_gone([reaper_pid, *pids], 15) == []


def test_only_an_engine_that_dies_with_its_parent_runs_under_the_reaper():
    spec = EngineSpec("decode", "/m", "m", 8100, 8101)
    direct = launch_argv(spec, die_with_parent=False)
    reaped = launch_argv(spec, die_with_parent=True)
    assert reaped == [sys.executable, "-m", "launch.reaper", "--", *direct]
    assert direct[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]


def test_a_child_whose_parent_is_already_gone_exits_instead_of_waiting_for_a_signal():
    """The parent died between the fork and the prctl: the death signal will never come."""
    out = subprocess.run([sys.executable, "-c", "from launch.reaper import die_with_parent; "
                          "die_with_parent(parent=1); print('still here')"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "still here" not in out.stdout


def test_die_with_parent_sets_the_death_signal():
    out = subprocess.run(
        [sys.executable, "-c", "import ctypes; from launch.reaper import die_with_parent; "
         "die_with_parent(); libc = ctypes.CDLL('libc.so.6'); v = ctypes.c_int(); "
         "libc.prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)"],
        capture_output=True, text=True, check=True)
    assert int(out.stdout) == signal.SIGTERM
