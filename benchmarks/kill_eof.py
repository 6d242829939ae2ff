"""How long a SIGKILLed process's peer waits to see its connection close: the part of a
migrated stream's break before the proxy can know the engine is gone (``benchmarks/migration``).

The kernel closes a killed process's sockets only after tearing down its memory, so the wait
grows with what the process has mapped. Per round, arms shuffled: a fresh child process that
imports the arm's modules, listens on loopback and accepts one connection; the parent holds
the connection, SIGKILLs the child and times the EOF. Arms: a bare interpreter, one that has
imported torch, and one that has imported vLLM's OpenAI API server (what a real engine's
server has mapped, less its model and its requests).

Run: ``python -m benchmarks.kill_eof [--rounds 10]``. Writes
``benchmarks/results/kill_eof.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import exit_on_sigterm, log, save_results

ARMS = {
    "bare python": "",
    "import torch": "import torch",
    "import vllm's API server": "import vllm.entrypoints.openai.api_server",
}

_CHILD = """
import socket, sys, time
{imports}
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
print(s.getsockname()[1], flush=True)
conn, _ = s.accept()
while True:
    time.sleep(60)
"""


def one(imports: str) -> float:
    """Seconds from SIGKILL to EOF on a connection to a child that ran ``imports``."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(imports=imports)],
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            time.sleep(0.3)  # accepted and idle
            t0 = time.perf_counter()
            os.kill(child.pid, signal.SIGKILL)
            assert conn.recv(1) == b""
            return time.perf_counter() - t0
    finally:
        child.kill()
        child.wait()


def main(argv: list[str] | None = None) -> None:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        order = list(ARMS)
        random.shuffle(order)
        for arm in order:
            times[arm].append(one(ARMS[arm]))
        log(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{arm} {1e3 * times[arm][-1]:.1f} ms" for arm in ARMS))
    summary = {arm: {"p50_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t),
                     "max_ms": 1e3 * max(t)} for arm, t in times.items()}
    for arm, s in summary.items():
        log(f"{arm}: SIGKILL -> EOF p50 {s['p50_ms']:.1f} ms [{s['min_ms']:.1f}-"
            f"{s['max_ms']:.1f}]")

    def draw(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        ax.boxplot([[1e3 * x for x in t] for t in times.values()], tick_labels=list(times))
        ax.set_ylabel("SIGKILL -> the peer's EOF (ms)")
        ax.set_title(f"a killed process's connection closes after its teardown "
                     f"({args.rounds} rounds, arms shuffled)")

    save_results("kill_eof", {"config": vars(args), "times_s": times, "summary": summary},
                 draw)


if __name__ == "__main__":
    main()
