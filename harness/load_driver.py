"""Closed-loop streaming load against fake engines, shared by ``test_load.py`` and
``benchmarks/soak.py``.

``run_load`` runs ``concurrency`` clients, each sending one streamed chat request after another
until ``seconds`` are up (a request started before the end runs to its end), and returns what
every request saw: status, time to the first SSE event, and whether the stream was whole (every
event for this request's id, no in-band error, ending with ``data: [DONE]``). ``make_fast``
turns a fake into a fast decode engine: ~8 frames per stream with a token's pause between them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from harness.fake_engine import FakeEngine

CHAT_PATH = "/v1/chat/completions"
#: Seven content frames: with the role frame first and [DONE] last, nine events per stream.
FAST_TOKENS = ("The", " quick", " brown", " fox", " jumps", " over", ".")
FAST_FRAME_INTERVAL_S = 0.002
_DONE = b"data: [DONE]\n\n"


def make_fast(decode: FakeEngine) -> FakeEngine:
    decode.stream_tokens = FAST_TOKENS
    decode.decode_frame_interval_s = FAST_FRAME_INTERVAL_S
    return decode


def load_body() -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "Count to eight, quickly please."}],
        "max_tokens": len(FAST_TOKENS),
        "stream": True,
    }


@dataclass(frozen=True)
class StreamOutcome:
    request_id: str
    status: int
    #: Request sent -> first SSE event received (None when none arrived).
    ttft_s: float | None
    total_s: float
    events: int
    done: bool
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None


async def stream_once(session: aiohttp.ClientSession, url: str, request_id: str
                      ) -> StreamOutcome:
    payload = json.dumps(load_body()).encode()
    headers = {"content-type": "application/json", "x-request-id": request_id}
    t0 = time.perf_counter()
    ttft: float | None = None
    body = b""
    status = 0
    try:
        async with session.post(url, data=payload, headers=headers) as resp:
            status = resp.status
            async for chunk in resp.content.iter_any():
                if ttft is None and chunk:
                    ttft = time.perf_counter() - t0
                body += chunk
    except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
        return StreamOutcome(request_id, status, ttft, time.perf_counter() - t0, 0, False,
                             f"{type(exc).__name__}: {exc}")
    total = time.perf_counter() - t0
    return StreamOutcome(request_id, status, ttft, total, body.count(b"\n\n"),
                         body.endswith(_DONE), _check_stream(status, body, request_id))


def _check_stream(status: int, body: bytes, request_id: str) -> str | None:
    if status != 200:
        return f"status {status}: {body[:200]!r}"
    if not body.endswith(_DONE):
        return f"no [DONE] at the end: {body[-200:]!r}"
    for event in body[:-len(_DONE)].split(b"\n\n")[:-1]:
        if not event.startswith(b"data: "):
            return f"not an SSE data event: {event[:200]!r}"
        data = json.loads(event[len(b"data: "):])
        if "error" in data:
            return f"in-band error: {data['error']}"
        if data.get("id") != f"chatcmpl-{request_id}":
            return f"an event of another request: {data.get('id')!r}"
    return None


async def run_load(url: str, concurrency: int, seconds: float, tag: str,
                   timeout_s: float = 60.0) -> list[StreamOutcome]:
    """``concurrency`` clients in a closed loop for ``seconds``; ids are ``<tag>-<client>-<n>``."""
    outcomes: list[StreamOutcome] = []
    end = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client(i: int) -> None:
            n = 0
            while time.perf_counter() < end:
                outcomes.append(await stream_once(session, url, f"{tag}-{i}-{n}"))
                n += 1

        await asyncio.gather(*(client(i) for i in range(concurrency)))
    return outcomes


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None when empty."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ttfts_ms(outcomes: Iterable[StreamOutcome]) -> list[float]:
    return [o.ttft_s * 1e3 for o in outcomes if o.ok and o.ttft_s is not None]


def ttft_summary_ms(outcomes: Iterable[StreamOutcome]) -> dict[str, float | int | None]:
    xs = ttfts_ms(outcomes)
    return {"n": len(xs), "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99), "max": max(xs) if xs else None}


def proxy_added_ms(direct: Iterable[StreamOutcome], proxied: Iterable[StreamOutcome]
                   ) -> dict[str, float | None]:
    """Proxied minus direct TTFT at each percentile (both runs against the same fake)."""
    d, p = ttft_summary_ms(direct), ttft_summary_ms(proxied)
    out: dict[str, float | None] = {}
    for q in ("p50", "p90", "p99"):
        dq, pq = d[q], p[q]
        out[q] = None if dq is None or pq is None else float(pq) - float(dq)
    return out
