"""What a long prompt costs the proxy, and everyone else on it, as prompts grow to 128k tokens.

Setup: two lean fake engines (``benchmarks/lean_engine.py``: one prefill, one decode, each in its
own process, built not to stall on long bodies) behind two proxies that differ in one setting:

- ``pool``: prompts over ``INLINE_CHARS`` characters are tokenized in worker processes
  (``proxy/tokenizer_pool.py``), the way pdserve runs;
- ``inline``: every prompt is tokenized on the proxy's event loop (the behaviour before it).

Both run ``policy=threshold:0`` (every request tokenized, looked up and sent P/D) with the
SmolLM2 tokenizer, a 1 ms event-loop probe (``pd_event_loop_lag_seconds``) and a context long
enough for the largest prompt. For each prompt length (chat prompts of random words, 1k, 8k,
32k and 128k tokens by default):

1. ``tokenize``: ``PromptTokenizer.ids`` on the prompt in this process (template + encode), the
   floor for what any proxy that tokenizes pays.
2. TTFT, arms interleaved per round in a shuffled order: ``direct_pd`` (this client does the
   prefill and decode hops itself), ``pool``, ``inline``. Added TTFT = arm - direct_pd (p50),
   the proxy's CPU per request (the proxy and its tokenizer workers, from ``/proc``), and the
   longest event-loop stall the probe saw during the arm's requests.
3. Slow callbacks: the same requests through two more proxies (``pool`` and ``inline``
   settings) on asyncio's loop in debug mode, which logs each callback that held the loop over
   1 ms and for how long: the direct count of "a single call held the loop" (the ``inline`` one
   shows the detector works). The probe also sees the box itself: the other proxy's probe, idle
   meanwhile, is printed as the floor.
4. Streams in flight: ``--streams`` long streams through the arm's proxy (a frame every
   ``--frame-ms``), while requests arrive every ``--arrival-s``: a long prompt, or (interleaved,
   the control) a 16-token one. The gaps the streams see while each kind is in flight: p99 with
   long arrivals minus p99 with short ones is what a long prompt adds to everyone else.

Targets (issue 13): worst loop stall <= 2 ms at every length; streams gain <= 2 ms at p99 when
128k prompts arrive; added TTFT at 32k <= 1.2x the tokenization time alone.

Run: ``python -m benchmarks.long_prompts`` (``--help``; ``--sizes 1024,8192`` for a quick run).
Writes ``benchmarks/results/long_prompts.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from benchmarks.common import (
    ROOT,
    exit_on_sigterm,
    log,
    save_results,
    summarize,
    timed_stream,
)
from harness.stack import http_status
from transport import kv_params

CHAT = "/v1/chat/completions"
TARGET_STALL_MS = 2.0
TARGET_STREAM_GAIN_MS = 2.0
TARGET_TTFT_FACTOR = 1.2
WORDS = ("river stone lantern orbit meadow copper signal harbor velvet thunder quiet maple "
         "engine silver window garden planet shadow marble candle forest bridge violet ember "
         "canyon whisper falcon timber glacier crystal harvest beacon compass mosaic").split()
_LAG = "pd_event_loop_lag_seconds"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.long_prompts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1024,8192,32768,131072", help="prompt tokens")
    p.add_argument("--rounds", type=int, default=12, help="TTFT rounds per size (one per arm)")
    p.add_argument("--streams", type=int, default=4, help="streams in flight")
    p.add_argument("--frame-ms", type=float, default=5.0, help="their pause between frames")
    p.add_argument("--arrivals", type=int, default=8,
                   help="long (and as many short) arrivals per size and arm")
    p.add_argument("--arrival-s", type=float, default=0.6, help="time between arrivals")
    p.add_argument("--tokenizer-workers", type=int, default=2)
    p.add_argument("--base-port", type=int, default=29000)
    p.add_argument("--name", default="long_prompts")
    p.add_argument("--seed", type=int, default=0)
    # internal: the proxy subprocess
    p.add_argument("--serve-proxy", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- servers ----------------------------------------------------------------------------------


def serve_proxy(config_json: str, port: int) -> None:
    """The proxy; with ``x_slow_callback_ms`` in the config, on asyncio's own loop in debug
    mode, which logs every callback that held the loop longer than that (and how long)."""
    import logging

    import uvicorn

    from proxy.app import create_app
    from proxy.config import ProxyConfig
    from proxy.server import uvicorn_config

    settings = json.loads(config_json)
    slow_ms = settings.pop("x_slow_callback_ms", None)
    config = ProxyConfig(**settings)
    server_config = uvicorn_config(create_app(config), config, "127.0.0.1", port)
    if slow_ms is not None:
        import asyncio.base_events

        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        init = asyncio.base_events.BaseEventLoop.__init__

        def debug_init(loop, *a, **k):  # type: ignore[no-untyped-def]
            init(loop, *a, **k)
            loop.set_debug(True)
            loop.set_debug = lambda enabled: None  # uvicorn's runner would set it back
            loop.slow_callback_duration = slow_ms / 1e3

        asyncio.base_events.BaseEventLoop.__init__ = debug_init  # type: ignore[method-assign]
        _log_gc_pauses(slow_ms / 2)
        server_config.loop = "asyncio"
    uvicorn.Server(server_config).run()


def _log_gc_pauses(threshold_ms: float) -> None:
    """Log every garbage collection that takes over ``threshold_ms`` (debug arms only)."""
    import gc

    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started and (ms := (time.perf_counter() - started[0]) * 1e3) > threshold_ms:
            print(f"GC gen {info['generation']} took {ms:.2f} ms "
                  f"({info['collected']} collected)", file=sys.stderr, flush=True)

    gc.callbacks.append(callback)


class Process:
    """A server subprocess of this benchmark, ready when ``/health`` answers 200."""

    def __init__(self, name: str, argv: list[str], url: str, log_dir: Path):
        self.name, self.url = name, url
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "wb") as out:
            self.popen = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while http_status(url + "/health", 1.0) != 200:
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.2)

    def cpu_s(self) -> float:
        """CPU seconds of the process and its children (the tokenizer workers)."""
        try:
            proc = psutil.Process(self.popen.pid)
            procs = [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


# --- prompts ----------------------------------------------------------------------------------


def chat_prompt(tokenizer: Any, n_tokens: int, rng: random.Random) -> tuple[dict, int]:
    """A chat body of random words whose rendered prompt is about ``n_tokens`` tokens."""
    words: list[str] = []
    n = 0
    while n < n_tokens:
        words += [rng.choice(WORDS) for _ in range(max(16, (n_tokens - n) * 3 // 4))]
        n = len(tokenizer.ids({"messages": [{"role": "user", "content": " ".join(words)}]}))
    while n > n_tokens and len(words) > 1:
        del words[-max(1, (n - n_tokens) // 2):]
        n = len(tokenizer.ids({"messages": [{"role": "user", "content": " ".join(words)}]}))
    return {"messages": [{"role": "user", "content": " ".join(words)}]}, n


def tokenize_time_s(tokenizer: Any, body: dict, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokenizer.ids(body)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --- measurements -----------------------------------------------------------------------------


async def max_lag_ms(session: aiohttp.ClientSession, url: str, since: dict[str, float]) -> float:
    """The largest bucket bound the loop-lag histogram gained samples in since ``since``."""
    now = await lag_buckets(session, url)
    worst = 0.0
    for le, count in now.items():
        if count > since.get(le, 0) and le != "+Inf":
            worst = max(worst, float(le) * 1e3)
    if now.get("+Inf", 0) > since.get("+Inf", 0) and worst == 0.0:
        worst = float("inf")
    # A bucket bound is an upper bound; a count only in +Inf means "over the last bound".
    return worst


async def lag_buckets(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(_LAG + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[le] = float(line.rsplit(" ", 1)[1])
    # cumulative -> per bucket
    per: dict[str, float] = {}
    prev = 0.0
    for le in sorted(out, key=lambda x: float("inf") if x == "+Inf" else float(x)):
        per[le] = out[le] - prev
        prev = out[le]
    return per


async def direct_pd_ttft(session: aiohttp.ClientSession, prefill: str, decode: str, body: dict,
                         n_tokens: int) -> float:
    """The client does both hops itself: the floor a proxy adds to."""
    pbody = dict(body, max_tokens=1, stream=False, return_token_ids=True, x_prompt_tokens=n_tokens)
    pbody[kv_params.BODY_KEY] = kv_params.prefill_request_params()
    t0 = time.perf_counter()
    async with session.post(prefill + CHAT, json=pbody) as r:
        raw = await r.read()
    handoff = kv_params.parse_prefill_json(raw)
    dbody = dict(body, stream=True, max_tokens=2)
    dbody[kv_params.BODY_KEY] = kv_params.decode_request_params(handoff, raw_ids=True)
    import msgspec

    async with session.post(decode + CHAT, data=msgspec.json.encode(dbody),
                            headers={"content-type": "application/json"}) as r:
        async for _ in r.content.iter_any():
            return time.perf_counter() - t0
    raise RuntimeError("direct decode sent nothing")


async def ttft_rounds(session: aiohttp.ClientSession, proxies: dict[str, Process],
                      engines: tuple[str, str], body: dict, n_tokens: int, rounds: int,
                      rng: random.Random) -> dict[str, Any]:
    arms = ["direct_pd", *proxies]
    ttft: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {a: [] for a in proxies}
    lag: dict[str, float] = dict.fromkeys(proxies, 0.0)
    idle_lag: dict[str, float] = dict.fromkeys(proxies, 0.0)  # the other proxy, idle meanwhile
    errors: list[str] = []
    for arm, proc in proxies.items():  # not counted: first-use costs of this prompt size
        for _ in range(2):
            await timed_stream(session, proc.url + CHAT,
                               dict(body, stream=True, max_tokens=2, x_prompt_tokens=n_tokens))
    for _ in range(rounds):
        rng.shuffle(arms)
        for arm in arms:
            if arm == "direct_pd":
                ttft[arm].append(await direct_pd_ttft(session, *engines, body, n_tokens))
                continue
            proc = proxies[arm]
            before = await lag_buckets(session, proc.url)
            others = {o: await lag_buckets(session, p.url) for o, p in proxies.items() if o != arm}
            c0 = proc.cpu_s()
            t = await timed_stream(session, proc.url + CHAT,
                                   dict(body, stream=True, max_tokens=2, x_prompt_tokens=n_tokens))
            cpu[arm].append(proc.cpu_s() - c0)
            if t.ttft_s is None:
                errors.append(f"{arm}: {t.status} {t.error}")
                continue
            ttft[arm].append(t.ttft_s)
            lag[arm] = max(lag[arm], await max_lag_ms(session, proc.url, before))
            for other, since in others.items():
                idle_lag[arm] = max(idle_lag[arm],
                                    await max_lag_ms(session, proxies[other].url, since))
    base = statistics.median(ttft["direct_pd"])
    out: dict[str, Any] = {"direct_pd_ttft_ms": summarize(ttft["direct_pd"], 1e3),
                           "errors": errors}
    for arm in proxies:
        out[arm] = {"ttft_ms": summarize(ttft[arm], 1e3),
                    "added_ttft_ms_p50": (statistics.median(ttft[arm]) - base) * 1e3
                    if ttft[arm] else None,
                    "cpu_ms_per_request": summarize(cpu[arm], 1e3),
                    "max_loop_stall_ms": lag[arm],
                    # the same probe in the other proxy, idle meanwhile: this box's floor
                    "idle_proxy_max_lag_ms": idle_lag[arm]}
    return out


async def streams_in_flight(session: aiohttp.ClientSession, proxy: Process, long_body: dict,
                            n_tokens: int, args: argparse.Namespace, rng: random.Random
                            ) -> dict[str, Any]:
    """Gaps of streams in flight while long (or, interleaved, short) prompts arrive."""
    frame_s = args.frame_ms / 1e3
    span_s = args.arrivals * 2 * args.arrival_s + 5.0
    n_frames = int(span_s / frame_s)
    windows: list[tuple[str, float, float]] = []  # (kind, start, end) of each arrival
    short = {"messages": [{"role": "user", "content": "a short question about rivers"}]}

    async def one_stream() -> list[float]:
        t = await timed_stream(session, proxy.url + CHAT, {
            "messages": [{"role": "user", "content": "stream"}], "stream": True,
            "max_tokens": n_frames, "x_frame_interval_s": frame_s, "x_prompt_tokens": 8},
            timeout_s=span_s + 120)
        return t.content_times

    streams = [asyncio.create_task(one_stream()) for _ in range(args.streams)]
    await asyncio.sleep(1.0)  # all streams under way
    kinds = ["long", "short"] * args.arrivals
    rng.shuffle(kinds)
    before = await lag_buckets(session, proxy.url)
    for kind in kinds:
        body = long_body if kind == "long" else short
        n = n_tokens if kind == "long" else 8
        t0 = time.perf_counter()
        t = await timed_stream(session, proxy.url + CHAT,
                               dict(body, stream=True, max_tokens=2, x_prompt_tokens=n))
        windows.append((kind, t0, t.t_first_content or time.perf_counter()))
        await asyncio.sleep(max(0.0, args.arrival_s - (time.perf_counter() - t0)))
    stall = await max_lag_ms(session, proxy.url, before)
    times = await asyncio.gather(*streams)
    gaps: dict[str, list[float]] = {"long": [], "short": []}
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            for kind, w0, w1 in windows:
                if a < w1 and b > w0:  # the gap overlaps this arrival's time in the proxy
                    gaps[kind].append(b - a - frame_s)
                    break
    p99 = {k: (sorted(v)[int(0.99 * (len(v) - 1))] * 1e3 if v else None) for k, v in gaps.items()}
    return {"gap_over_frame_ms": {k: summarize(v, 1e3) for k, v in gaps.items()},
            "p99_gain_ms": (p99["long"] - p99["short"]) if None not in p99.values() else None,
            "max_loop_stall_ms": stall, "frames_per_stream": n_frames}


async def slow_callbacks(session: aiohttp.ClientSession, proxy: Process, body: dict,
                         n_tokens: int, rounds: int) -> dict[str, Any]:
    """Requests of this size through the debug-mode proxy: every callback that held its loop
    over the threshold, as asyncio logged it (duration and what it was)."""
    start = proxy.log_path.stat().st_size
    for _ in range(rounds):
        await timed_stream(session, proxy.url + CHAT,
                           dict(body, stream=True, max_tokens=2, x_prompt_tokens=n_tokens))
    await asyncio.sleep(0.5)
    with open(proxy.log_path, "rb") as f:
        f.seek(start)
        lines = f.read().decode(errors="replace").splitlines()
    slow = []
    for line in lines:
        if line.startswith("Executing ") and " took " in line:
            seconds = float(line.rsplit(" took ", 1)[1].split()[0])
            slow.append((seconds * 1e3, line[10:160]))
    slow.sort(reverse=True)
    # Callbacks whose own work is microseconds (the lag probe, a timer setting a future) can
    # only be slow because the OS took the CPU away meanwhile: counted apart.
    trivial = [s for s in slow if "watch_loop_lag" in s[1] or "_set_result_unless" in s[1]]
    work = [s for s in slow if s not in trivial]
    return {"requests": rounds, "over_threshold": len(slow),
            "max_ms": slow[0][0] if slow else 0.0,
            "trivial_over_threshold": len(trivial), "work_over_threshold": len(work),
            "work_max_ms": work[0][0] if work else 0.0, "worst": slow[:8]}


# --- report -----------------------------------------------------------------------------------


def plot(results: dict[str, Any]):
    def draw(fig) -> None:
        sizes = [int(s) for s in results["sizes"]]
        arms = ["pool", "inline"]
        panels = [("added TTFT p50 (ms)", lambda r, a: r["ttft"][a]["added_ttft_ms_p50"]),
                  ("max event-loop stall (ms)", lambda r, a: r["ttft"][a]["max_loop_stall_ms"]),
                  ("streams: p99 gap gain (ms)", lambda r, a: r["streams"][a]["p99_gain_ms"]),
                  ("proxy CPU per request p50 (ms)",
                   lambda r, a: r["ttft"][a]["cpu_ms_per_request"].get("p50"))]
        for i, (title, get) in enumerate(panels):
            ax = fig.add_subplot(2, 2, i + 1)
            for arm in arms:
                ys = [get(results["sizes"][str(s)], arm) for s in sizes]
                ax.plot(sizes, [y if y is not None and y != float("inf") else float("nan")
                                for y in ys], marker="o", label=arm)
            if i == 0:
                ax.plot(sizes, [results["sizes"][str(s)]["tokenize_ms"] for s in sizes],
                        "k--", label="tokenize alone")
            ax.set_xscale("log")
            ax.set_title(title)
            ax.set_xlabel("prompt tokens")
            ax.legend()
    return draw


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from launch.models import ensure_model
    from proxy.tokens import PromptTokenizer

    rng = random.Random(args.seed)
    sizes = [int(x) for x in args.sizes.split(",")]
    model = str(ensure_model("smollm2"))
    tokenizer = PromptTokenizer(model)
    log_dir = ROOT / ".pdserve" / "bench-long-prompts"
    port = args.base_port
    engines = [Process(role, [sys.executable, "-m", "benchmarks.lean_engine", "--port",
                              str(port + i)], f"http://127.0.0.1:{port + i}", log_dir)
               for i, role in enumerate(("prefill", "decode"))]
    proxies: dict[str, Process] = {}
    try:
        arms = (("pool", None, None), ("inline", 1 << 40, None), ("debug_pool", None, 1.0),
                ("debug_inline", 1 << 40, 1.0))
        for i, (arm, inline_chars, slow_ms) in enumerate(arms):
            config = {"prefill_urls": [engines[0].url], "decode_urls": [engines[1].url],
                      "served_model_names": ["m"], "policy": "threshold:0", "warmup": False,
                      "tokenizer": model, "tokenizer_workers": args.tokenizer_workers,
                      "max_model_len": 2 * max(sizes), "loop_lag_probe_s": 0.001,
                      "body_limit_bytes": 64 << 20}
            if inline_chars is not None:
                config["tokenizer_inline_chars"] = inline_chars
            if slow_ms is not None:
                config["x_slow_callback_ms"] = slow_ms
            proxies[arm] = Process(
                f"proxy-{arm}", [sys.executable, "-m", "benchmarks.long_prompts",
                                 "--serve-proxy", json.dumps(config), "--base-port",
                                 str(port + 10 + i)],
                f"http://127.0.0.1:{port + 10 + i}", log_dir)
        debug = {arm: proxies.pop(f"debug_{arm}") for arm in ("pool", "inline")}
        results: dict[str, Any] = {"sizes": {}, "config": vars(args)}
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for size in sizes:
                body, n = chat_prompt(tokenizer, size, rng)
                tok_s = tokenize_time_s(tokenizer, body)
                log(f"{n} tokens ({len(body['messages'][0]['content'])} chars): tokenize "
                    f"{tok_s * 1e3:.1f} ms; TTFT rounds ...")
                entry: dict[str, Any] = {"prompt_tokens": n, "tokenize_ms": tok_s * 1e3,
                                         "ttft": await ttft_rounds(
                                             session, proxies, (engines[0].url, engines[1].url),
                                             body, n, args.rounds, rng), "streams": {}}
                for arm, proc in proxies.items():
                    log(f"{n} tokens: streams in flight through {arm} ...")
                    entry["streams"][arm] = await streams_in_flight(session, proc, body, n,
                                                                    args, rng)
                entry["slow_callbacks"] = {
                    arm: await slow_callbacks(session, proc, body, n, args.rounds)
                    for arm, proc in debug.items()}
                results["sizes"][str(size)] = entry
                report_size(entry)
        return results
    finally:
        for proc in [*proxies.values(), *engines, *locals().get("debug", {}).values()]:
            proc.stop()


def report_size(entry: dict[str, Any]) -> None:
    n, tok = entry["prompt_tokens"], entry["tokenize_ms"]
    for arm in ("pool", "inline"):
        t, s = entry["ttft"][arm], entry["streams"][arm]
        added = t["added_ttft_ms_p50"]
        log(f"  {n:7d} tok {arm:6s}: added TTFT {added:8.1f} ms (x{added / tok:4.2f} of tokenize "
            f"{tok:.1f}), CPU/request {t['cpu_ms_per_request'].get('p50', 0):7.1f} ms, "
            f"max loop stall {t['max_loop_stall_ms']:g} ms (streams: {s['max_loop_stall_ms']:g}"
            f" ms), streams p99 gap gain {s['p99_gain_ms']:+.1f} ms; idle proxy's probe "
            f"meanwhile {t['idle_proxy_max_lag_ms']:g} ms")
    for arm, slow in entry["slow_callbacks"].items():
        log(f"  {n:7d} tok {arm:6s} in asyncio debug mode ({slow['requests']} requests): "
            f"{slow['work_over_threshold']} callbacks over 1 ms doing work (longest "
            f"{slow['work_max_ms']:.0f} ms), {slow['trivial_over_threshold']} trivial ones "
            "(probe, timer: preempted by the OS)")


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    sizes = results["sizes"]
    pool = {s: e["ttft"]["pool"] for s, e in sizes.items()}
    stalls = {s: max(e["ttft"]["pool"]["max_loop_stall_ms"],
                     e["streams"]["pool"]["max_loop_stall_ms"]) for s, e in sizes.items()}
    gains = {s: e["streams"]["pool"]["p99_gain_ms"] for s, e in sizes.items()}
    out: dict[str, Any] = {
        "max_loop_stall_ms": stalls,
        "stall_target_met": all(v <= TARGET_STALL_MS for v in stalls.values()),
        "stream_p99_gain_ms": gains,
    }
    biggest = max(sizes, key=int)
    out["stream_gain_target_met"] = gains[biggest] is not None and (
        gains[biggest] <= TARGET_STREAM_GAIN_MS)
    if "32768" in sizes:
        factor = pool["32768"]["added_ttft_ms_p50"] / sizes["32768"]["tokenize_ms"]
        out["ttft_factor_32k"] = factor
        out["ttft_target_met"] = factor <= TARGET_TTFT_FACTOR
    per_token = {}
    ns = sorted(sizes, key=int)
    for arm in ("pool", "inline"):
        lo, hi = sizes[ns[0]], sizes[ns[-1]]
        dn = hi["prompt_tokens"] - lo["prompt_tokens"]
        if dn > 0:
            per_token[arm] = {
                "added_ttft_us_per_token": (hi["ttft"][arm]["added_ttft_ms_p50"]
                                            - lo["ttft"][arm]["added_ttft_ms_p50"]) * 1e3 / dn,
                "cpu_us_per_token": (hi["ttft"][arm]["cpu_ms_per_request"].get("p50", 0)
                                     - lo["ttft"][arm]["cpu_ms_per_request"].get("p50", 0))
                * 1e3 / dn}
    out["growth_per_token"] = per_token
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_proxy:
        serve_proxy(args.serve_proxy, args.base_port)
        return 0
    exit_on_sigterm()
    results = asyncio.run(run(args))
    results["verdict"] = verdict(results)
    log(f"verdict: {json.dumps(results['verdict'], indent=1)}")
    json_path, png_path = save_results(args.name, results, plot(results))
    log(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
