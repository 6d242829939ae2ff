"""Soak: the proxy in front of fast fake engines, many streaming clients for a minute.

The same load as ``tests/proxy/test_load.py``, for longer and written down: ``--concurrency``
clients each send one streamed chat request after another (fake prefill answers at once, fake
decode streams nine SSE events with a 2 ms pause between frames). Two runs side by side:

- ``direct`` — the clients stream straight from the decode fake (``--direct-seconds``);
- ``proxied`` — the same requests through the proxy, route disaggregated (``--seconds``).

Reported: requests, errors, requests seen by each fake (every proxied request must reach prefill
and decode exactly once), TTFT (request sent -> first SSE event) p50/p90/p99 of both runs and
their difference (the proxy-added TTFT), and the proxy's ``pd_inflight_requests`` after the run
(0 = no admission slot leaked). The fakes are the tests' (``tests/proxy/``).

By default the proxy runs in this process's event loop, with the fakes and the clients, as in the
test; ``--proxy-process`` runs it in its own process (uvicorn's default loop, as ``pdserve dev``
does), so it does not share a core's time with the clients. Nothing here asserts (STYLE rule 14).

Run: ``python -m benchmarks.soak --seconds 60 --concurrency 64``.
Writes ``benchmarks/results/<name>.json`` and ``.png`` (TTFT histograms, direct vs proxied).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import ROOT, exit_on_sigterm, log, machine_info, save_results
from harness.fake_engine import FakeEngine
from harness.live_proxy import live_proxy, proxy_config
from harness.load_driver import (
    CHAT_PATH,
    FAST_FRAME_INTERVAL_S,
    FAST_TOKENS,
    StreamOutcome,
    make_fast,
    percentile,
    proxy_added_ms,
    run_load,
    ttft_summary_ms,
    ttfts_ms,
)
from proxy.config import ProxyConfig

PROXY_START_TIMEOUT_S = 60.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="length of the proxied run")
    p.add_argument("--direct-seconds", type=float, default=15.0,
                   help="length of the direct run (clients -> decode fake)")
    p.add_argument("--concurrency", type=int, default=64, help="clients, each in a closed loop")
    p.add_argument("--proxy-process", action="store_true",
                   help="run the proxy in its own process instead of this event loop")
    p.add_argument("--name", default="soak", help="results file name (without extension)")
    p.add_argument("--serve-proxy", metavar="CONFIG_JSON", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- the proxy, here or in a child process ------------------------------------------------------


@contextlib.asynccontextmanager
async def running_proxy(config: ProxyConfig, in_process: bool) -> AsyncIterator[str]:
    """Yield the proxy's base URL."""
    if in_process:
        async with live_proxy(config) as lp:
            yield lp.url
        return
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.soak", "--serve-proxy", config.model_dump_json(),
        stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), PROXY_START_TIMEOUT_S)
        if not line.strip().isdigit():
            raise RuntimeError(f"proxy process did not start (said {line!r})")
        yield f"http://127.0.0.1:{int(line)}"
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def serve_proxy(config_json: str) -> int:
    """Child mode: serve the proxy on an ephemeral loopback port; print the port; run till SIGTERM."""
    import uvicorn

    from proxy.app import create_app
    from proxy.server import uvicorn_config

    config = ProxyConfig.model_validate_json(config_json)
    server = uvicorn.Server(uvicorn_config(create_app(config), config, "127.0.0.1", 0,
                                           timeout_graceful_shutdown=5))

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                await task
                return
            await asyncio.sleep(0.01)
        print(server.servers[0].sockets[0].getsockname()[1], flush=True)
        await task

    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
        runner.run(serve())
    return 0


async def scrape_proxy(url: str) -> dict[str, float]:
    """The proxy's series of interest after the run (label sets joined into the key)."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("pd_inflight_requests", "pd_requests_total",
                          "pd_client_disconnects_total", "pd_stream_errors_total",
                          "pd_fallbacks_total", "pd_rejected_total"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# --- the runs -----------------------------------------------------------------------------------


def run_report(outcomes: list[StreamOutcome], seconds: float) -> dict[str, Any]:
    errors = collections.Counter(o.error for o in outcomes if not o.ok)
    return {
        "requests": len(outcomes),
        "requests_per_s": len(outcomes) / seconds,
        "errors": sum(errors.values()),
        "error_samples": [{"error": e, "count": n} for e, n in errors.most_common(5)],
        "ttft_ms": ttft_summary_ms(outcomes),
        "stream_total_ms_p50": percentile([o.total_s * 1e3 for o in outcomes if o.ok], 50),
    }


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    prefill, decode = FakeEngine("prefill"), make_fast(FakeEngine("decode"))
    await prefill.start()
    await decode.start()
    try:
        config = proxy_config(prefill, decode)
        async with running_proxy(config, not args.proxy_process) as url:
            log(f"direct run: {args.concurrency} clients for {args.direct_seconds:g}s")
            direct = await run_load(decode.url + CHAT_PATH, args.concurrency,
                                    args.direct_seconds, "direct")
            direct_seen = len(decode.decode_requests)
            decode.decode_requests.clear()
            log(f"proxied run: {args.concurrency} clients for {args.seconds:g}s via {url}")
            t0 = time.perf_counter()
            proxied = await run_load(url + CHAT_PATH, args.concurrency, args.seconds, "proxy")
            proxied_s = time.perf_counter() - t0
            metrics_after = await scrape_proxy(url)
    finally:
        await prefill.stop()
        await decode.stop()

    client_ids = sorted(o.request_id for o in proxied)
    prefill_ids = sorted(r.request_id for r in prefill.prefill_requests)
    decode_ids = sorted(r.request_id for r in decode.decode_requests)
    return {
        "config": {
            "concurrency": args.concurrency, "seconds": args.seconds,
            "direct_seconds": args.direct_seconds,
            "proxy": "own process" if args.proxy_process else "same event loop as clients+fakes",
            "sse_events_per_stream": len(FAST_TOKENS) + 2,
            "decode_frame_interval_s": FAST_FRAME_INTERVAL_S,
        },
        "direct": run_report(direct, args.direct_seconds) | {"decode_seen": direct_seen},
        "proxied": run_report(proxied, proxied_s) | {
            "prefill_seen": len(prefill_ids),
            "decode_seen": len(decode_ids),
            "each_request_once_on_prefill": prefill_ids == client_ids,
            "each_request_once_on_decode": decode_ids == client_ids,
            "prefill_aborts": prefill.prefill_aborts,
            "decode_aborts": decode.decode_aborts,
        },
        "proxy_added_ttft_ms": proxy_added_ms(direct, proxied),
        "proxy_metrics_after": metrics_after,
        "_ttfts_ms": {"direct": ttfts_ms(direct), "proxied": ttfts_ms(proxied)},
    }


def plot(fig: Any, ttfts: dict[str, list[float]], title: str) -> None:
    import numpy as np

    values = [v for xs in ttfts.values() for v in xs if v > 0]
    if not values:
        return
    bins = np.geomspace(min(values), max(values) * 1.01, 60)
    ax = fig.add_subplot(1, 2, 1)
    for name, xs in ttfts.items():
        ax.hist(xs, bins=bins, alpha=0.55, label=f"{name} (n={len(xs)})")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT, ms (request sent -> first SSE event)")
    ax.set_ylabel("requests")
    ax.set_title(title)
    ax.legend()
    ax = fig.add_subplot(1, 2, 2)
    for name, xs in ttfts.items():
        ys = np.sort(xs)
        ax.plot(ys, np.arange(1, len(ys) + 1) / len(ys), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT, ms")
    ax.set_ylabel("fraction of requests")
    ax.set_title("CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_proxy is not None:
        return serve_proxy(args.serve_proxy)
    exit_on_sigterm()
    machine = machine_info()
    payload = asyncio.run(soak(args))
    ttfts = payload.pop("_ttfts_ms")
    payload["machine"] = machine
    try:
        import matplotlib  # noqa: F401

        title = (f"c={args.concurrency}, proxy {payload['config']['proxy']}, "
                 f"load avg {machine['loadavg_at_start'][0]:.1f}")
        drawer = lambda fig: plot(fig, ttfts, title)
    except ImportError:
        drawer = None
    json_path, png_path = save_results(args.name, payload, drawer)
    d, p, added = payload["direct"], payload["proxied"], payload["proxy_added_ttft_ms"]
    print(f"direct:  {d['requests']} requests, {d['errors']} errors, TTFT ms p50 "
          f"{d['ttft_ms']['p50']:.1f} p99 {d['ttft_ms']['p99']:.1f}")
    print(f"proxied: {p['requests']} requests ({p['requests_per_s']:.0f}/s), {p['errors']} "
          f"errors, prefill saw {p['prefill_seen']}, decode saw {p['decode_seen']}, exactly once: "
          f"{p['each_request_once_on_prefill'] and p['each_request_once_on_decode']}, TTFT ms "
          f"p50 {p['ttft_ms']['p50']:.1f} p99 {p['ttft_ms']['p99']:.1f}")
    print(f"proxy-added TTFT ms: p50 {added['p50']:.1f} p99 {added['p99']:.1f}; "
          f"pd_inflight_requests after: {payload['proxy_metrics_after'].get('pd_inflight_requests')}")
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
