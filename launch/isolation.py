"""Keep each engine on its own cores: every process and thread it starts, not just its model's.

``VLLM_CPU_OMP_THREADS_BIND`` pins only an engine's OpenMP compute threads. Its API server and
EngineCore processes, their threads, and the worker's other threads (gloo, ZMQ, NIXL/UCX) float
over every core, and measured on this 2-core box they are what stalls the *other* engine: a
decode engine's EngineCore busy-polls (6 min 39 s of CPU in a 15-minute run), and streams
decoding on one engine saw 6-23 s gaps until each engine's whole tree was confined by hand
(``../shared/STACK.md``).

So an engine process starts with its cores as its CPU affinity (:func:`confine`, run in the
child before exec); every process and thread it creates inherits them. vLLM re-pins some
threads itself: its OpenMP binding (to the same cores) and its NIXL worker, which "reserves the
last core" (``transport/nixl_cpu.py`` undoes that). :func:`strays` lists any thread of an
engine's tree found elsewhere, :func:`repin` puts it back; dev and Ray mode check after start-up
and report what they had to fix. :func:`sharing` names the engines that share a core when there
are more engines than cores (the Ray tests run three on two), which start-up reports.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import psutil


def parse_cores(text: str) -> frozenset[int]:
    """``"1"``, ``"0-3"``, ``"0,2-3"`` -> the set of core numbers."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    if not cores:
        raise ValueError(f"no cores in {text!r}")
    return frozenset(cores)


def confine(cores: Iterable[int]) -> None:
    """This process (and everything it starts from now on) runs only on ``cores``."""
    os.sched_setaffinity(0, set(cores))


@dataclass(frozen=True)
class ThreadPlace:
    pid: int
    tid: int
    name: str
    cores: frozenset[int]


def tree_threads(pid: int) -> list[ThreadPlace]:
    """Every thread of process ``pid`` and of all its descendants, with its affinity."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for proc in procs:
        try:
            tids = [t.id for t in proc.threads()]
        except psutil.NoSuchProcess:
            continue
        for tid in tids:
            try:
                cores = frozenset(os.sched_getaffinity(tid))
                with open(f"/proc/{proc.pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:  # the thread ended meanwhile
                continue
            out.append(ThreadPlace(proc.pid, tid, name, cores))
    return out


def strays(pid: int, cores: frozenset[int]) -> list[ThreadPlace]:
    """Threads of ``pid``'s tree allowed on any core outside ``cores``, or not on all of them."""
    return [t for t in tree_threads(pid) if t.cores != cores]


def repin(threads: Iterable[ThreadPlace], cores: frozenset[int]) -> list[ThreadPlace]:
    """Put ``threads`` back on ``cores``; return those that could not be (gone meanwhile)."""
    failed = []
    for t in threads:
        try:
            os.sched_setaffinity(t.tid, set(cores))
        except OSError:
            failed.append(t)
    return failed


def keep_confined(pid: int, cores: frozenset[int]) -> list[ThreadPlace]:
    """Re-pin whatever of ``pid``'s tree left ``cores``; return what was found outside."""
    found = strays(pid, cores)
    repin(found, cores)
    return found


def guard(engines: Iterable[tuple[str, int, str | None]], report) -> int:
    """For each ``(name, pid, cores)`` with cores: re-pin threads that left them and ``report``
    (a print-like callable) what was moved; return how many threads were moved in all."""
    moved = 0
    for name, pid, cores_text in engines:
        if not cores_text:
            continue
        found = keep_confined(pid, parse_cores(cores_text))
        if found:
            moved += len(found)
            names = sorted({t.name for t in found})
            report(f"{name}: {len(found)} thread(s) had left core(s) {cores_text} "
                   f"({', '.join(names)}): put back")
    return moved


def sharing(assignments: Mapping[str, frozenset[int]]) -> dict[int, list[str]]:
    """Cores given to more than one engine: core -> engine names (empty when none share)."""
    by_core: dict[int, list[str]] = {}
    for name, cores in assignments.items():
        for core in cores:
            by_core.setdefault(core, []).append(name)
    return {core: names for core, names in sorted(by_core.items()) if len(names) > 1}
