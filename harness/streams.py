"""Long greedy answers streaming through a proxy, each token's arrival time kept: what the
streams decoding on an engine see while something else happens there (a local prefill, a KV
pull). Used by the SLO-routing tests and ``benchmarks/local_stall.py``."""

from __future__ import annotations

import threading
import time

import httpx


class Streams:
    """Long greedy answers streaming through the proxy; every token's arrival time kept."""

    def __init__(self, stack, n: int = 2, max_tokens: int = 3000, slo: dict | None = None):
        self.max_tokens, self.slo = max_tokens, slo
        self.times: list[list[float]] = [[] for _ in range(n)]
        self.done = [False] * n  # each stream's [DONE] came
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(stack, i), daemon=True)
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, stack, i: int) -> None:
        body = {"model": stack.model_name, "prompt": f"story {i}",
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, **({"slo": self.slo} if self.slo else {})}
        with httpx.Client(timeout=300) as c, c.stream(
                "POST", stack.proxy_url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.times[i].append(time.perf_counter())
                if line == "data: [DONE]":
                    self.done[i] = True
                if self._stop.is_set():  # hang up: the proxy and the engine abort the stream
                    return

    def worst_gap(self, t0: float, t1: float) -> float:
        """The longest gap between two tokens of a stream that ends within [t0, t1]."""
        return max((b - a for ts in self.times for a, b in zip(ts, ts[1:]) if t0 < b <= t1),
                   default=0.0)

    def gaps(self, t0: float, t1: float) -> list[float]:
        return sorted(b - a for ts in self.times for a, b in zip(ts, ts[1:]) if t0 < b <= t1)

    def join(self) -> None:
        for t in self._threads:
            t.join(300)

    def stop(self) -> None:
        """Hang up every stream (a 3,000-token answer would run for a minute or more on a
        loaded box, and the next routing change waits for idle engines)."""
        self._stop.set()
        for t in self._threads:
            t.join(60)
