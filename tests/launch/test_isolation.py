"""launch/isolation.py on real processes: a confined child's whole tree stays on its cores,
a thread that moves itself is found and put back, shared cores are named."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from launch.isolation import confine, guard, parse_cores, sharing, strays, tree_threads

# A parent that starts a thread and a child process, then moves that thread to every core.
_SCRIPT = r"""
import os, subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
moved = threading.Event()
tid = []
def wander():
    os.sched_setaffinity(0, set(range(os.cpu_count())))
    tid.append(threading.get_native_id())
    moved.set()
    time.sleep(60)
threading.Thread(target=wander, daemon=True).start()
moved.wait()
print(tid[0], flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize(("text", "cores"), [("1", {1}), ("0-3", {0, 1, 2, 3}),
                                             ("0,2-3", {0, 2, 3})])
def test_parse_cores(text, cores):
    assert parse_cores(text) == frozenset(cores)


def test_sharing_names_engines_on_the_same_core():
    assert sharing({"p0": frozenset({0}), "d0": frozenset({1})}) == {}
    assert sharing({"p0": frozenset({0}), "d0": frozenset({1}), "d1": frozenset({1})}) == {
        1: ["d0", "d1"]}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_a_confined_tree_stays_and_a_wanderer_is_put_back():
    core = frozenset({1})
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: confine(core))
    try:
        wanderer = int(proc.stdout.readline())
        deadline = time.monotonic() + 10
        while len({t.pid for t in tree_threads(proc.pid)}) < 2:  # the grandchild is up
            assert time.monotonic() < deadline
            time.sleep(0.05)
        threads = tree_threads(proc.pid)
        # Inherited by everything (the grandchild included) but the thread that moved itself.
        assert [t.tid for t in strays(proc.pid, core)] == [wanderer]
        assert all(t.cores == core for t in threads if t.tid != wanderer)
        reports: list[str] = []
        assert guard([("engine", proc.pid, "1")], reports.append) == 1
        assert "1 thread(s) had left core(s) 1" in reports[0]
        assert strays(proc.pid, core) == []
    finally:
        family = {t.pid for t in tree_threads(proc.pid)}
        for pid in family:
            os.kill(pid, 9)
        proc.wait(5)
