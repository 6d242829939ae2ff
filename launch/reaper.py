"""Run one command so that nothing it starts outlives it, and it does not outlive our parent.

``python -m launch.reaper -- <argv>``. Every engine is started through this (dev mode's and a
Ray actor's, ``launch/processes.py``), because the kernel's parent-death signal reaches one
process only: an actor that dies outright (its raylet gone) SIGTERMs the vLLM API server, and vLLM's
``VLLM::EngineCore`` child, a grandchild of the actor, was left running (a cluster-loss test
found them; they then held the node's cores and ports).

The reaper is the engine's session leader and a *child subreaper* (``PR_SET_CHILD_SUBREAPER``):
whatever the command starts and orphans is re-parented to it, not to init, so it can always
find it. It
- dies with its own parent: SIGTERM (``PR_SET_PDEATHSIG``, set by the launcher), which it
  treats like any stop signal;
- forwards a stop signal (SIGTERM, SIGINT, SIGHUP) to the command, and SIGKILLs the command
  if it has not exited ``stop_grace_s`` later;
- once the command has exited, for any reason, SIGTERMs what is left of its descendants,
  SIGKILLs them ``grace_s`` later, reaps them all, and exits with the command's status
  (128 + N for a signal N, as a shell reports it).
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
#: How long the command may take to stop after a stop signal, and what it leaves behind
#: after it has exited, before SIGKILL (vLLM's own engine-core shutdown waits 5 s).
STOP_GRACE_S = 10.0
GRACE_S = 5.0
_POLL_S = 0.2
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _prctl(option: int, value: int) -> None:
    if ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def die_with_parent(parent: int | None = None, sig: int = signal.SIGTERM) -> None:
    """``sig`` to this process when the thread that started it ends (Linux); kept across exec.
    ``parent``: the pid that started it, when known; if it is already gone (it died between
    the fork and this call, so the signal will never come), exit at once."""
    _prctl(PR_SET_PDEATHSIG, sig)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def popen_dying_with_us(argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv, **popen_kwargs)`` whose process gets SIGTERM when this one
    ends, however it ends (SIGKILL and the OOM killer included); a ``preexec_fn`` given runs
    after that is set up.

    The kernel sends the parent-death signal when the *thread* that forked the child ends, not
    the process: so every such child is forked on one thread that lives as long as the
    process. (Dev mode restarts engines on its supervisor thread; forked there, they would be
    stopped whenever that thread ended.)"""
    parent, preexec = os.getpid(), popen_kwargs.pop("preexec_fn", None)

    def setup() -> None:
        die_with_parent(parent)
        if preexec is not None:
            preexec()

    return _on_forking_thread(lambda: subprocess.Popen(list(argv), preexec_fn=setup,
                                                       **popen_kwargs))


_forks: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
_forking_thread: threading.Thread | None = None
_forking_thread_lock = threading.Lock()


def _on_forking_thread(start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
    global _forking_thread
    with _forking_thread_lock:
        if _forking_thread is None or not _forking_thread.is_alive():
            # A daemon thread that never returns: it ends only with the process.
            _forking_thread = threading.Thread(target=_fork_forever, name="pdserve-forker",
                                               daemon=True)
            _forking_thread.start()
    started: Future[subprocess.Popen] = Future()
    _forks.put((start, started))
    return started.result()


def _fork_forever() -> None:
    while True:
        start, started = _forks.get()
        try:
            started.set_result(start())
        except BaseException as exc:  # the caller's to handle, not this thread's end
            started.set_exception(exc)


def descendants() -> list[int]:
    """Pids of every live process below this one (orphans included, once re-parented here)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [os.getpid()]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.append(pid)
            todo.append(pid)
    return found


def _reap() -> dict[int, int]:
    """Collect every exited child without blocking: pid -> wait status."""
    done: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done[pid] = status


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _exit_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def run(argv: Sequence[str], stop_grace_s: float = STOP_GRACE_S, grace_s: float = GRACE_S
        ) -> int:
    """Run ``argv`` under this process as its reaper; return its exit code (see module)."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    stop_at: list[float] = []  # when the first stop signal came
    child: subprocess.Popen | None = None

    def on_stop(signum, frame) -> None:
        if not stop_at:
            stop_at.append(time.monotonic())
        if child is not None and child.returncode is None:  # never a pid already reaped
            _signal_all([child.pid], signum)

    for sig in _STOP_SIGNALS:
        signal.signal(sig, on_stop)
    me = os.getpid()
    child = subprocess.Popen(list(argv), preexec_fn=lambda: die_with_parent(me))
    if stop_at:  # stopped while it was being started
        _signal_all([child.pid], signal.SIGTERM)
    while child.returncode is None:
        # Stop signals held while the child is reaped, so none lands on a reaped (reusable) pid.
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        status = _reap().get(child.pid)
        if status is not None:
            child.returncode = _exit_code(status)  # reaped here, not by Popen
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        if child.returncode is None:
            if stop_at and time.monotonic() - stop_at[0] > stop_grace_s:
                _signal_all([child.pid], signal.SIGKILL)
            time.sleep(_POLL_S)
    left = descendants()
    _signal_all(left, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        _reap()
        left = descendants()
    deadline = time.monotonic() + grace_s  # SIGKILLed; only a process stuck in the kernel stays
    while left and time.monotonic() < deadline:
        _signal_all(left, signal.SIGKILL)  # each pass: one forked since the last look too
        time.sleep(_POLL_S / 4)
        _reap()
        left = descendants()
    _reap()
    return child.returncode


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m launch.reaper -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
