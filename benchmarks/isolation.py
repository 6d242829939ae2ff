"""Do two engines on one box leave each other alone? Streams decoding on the decode engine, at
rest and while the prefill engine computes a long prompt, with each engine confined two ways.

Arms, switched at run time on the same two engines (``pdserve dev``, SmolLM2 by default), so
they interleave in one run:

- ``tree``: every process and thread of each engine on its own core (``launch/isolation.py``,
  what pdserve does);
- ``compute``: only the model's compute (the worker process, where vLLM's OpenMP binding puts
  it); the API server and EngineCore processes float over every core, as before pdserve
  confined the whole tree.

Per round and arm (shuffled): ``--rest-s`` of streams alone, then the same streams while one
``--prefill-tokens`` prompt is prefilled on the prefill engine (sent straight to it, one token).
The streams (``--streams``, straight to the decode engine, greedy, ``ignore_eos``) run
throughout; each gap between tokens is attributed to the window it ends in. Reported per arm:
p50/p99/max gap at rest and during prefills, their ratio (target: p99 during <= 2x p99 at rest),
and how long the prefills took.

Run: ``python -m benchmarks.isolation`` (``--help``). Writes ``benchmarks/results/isolation.json``
and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from typing import Any

import aiohttp

from benchmarks.common import (
    ROOT,
    Prompts,
    exit_on_sigterm,
    log,
    save_results,
    summarize,
    timed_post,
    timed_stream,
    wait_ports_free,
)
from harness.stack import Stack, start_dev
from launch.isolation import parse_cores, repin, tree_threads

TARGET_RATIO = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.isolation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--rest-s", type=float, default=5.0)
    p.add_argument("--prefill-tokens", type=int, default=1130)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--port", type=int, default=28000)
    p.add_argument("--engine-base-port", type=int, default=28100)
    p.add_argument("--side-channel-base-port", type=int, default=25600)
    p.add_argument("--kv-events-base-port", type=int, default=25700)
    p.add_argument("--name", default="isolation")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def place(stack: Stack, arm: str) -> dict[str, int]:
    """Put both engines' trees where ``arm`` says; return threads moved per engine."""
    all_cores = frozenset(range(os.cpu_count() or 1))
    moved = {}
    for engine in stack.run_info()["engines"]:
        own = parse_cores("0" if engine["role"] == "prefill" else "1")
        threads = tree_threads(engine["pid"])
        if arm == "tree":
            repin(threads, own)
        else:  # compute: the worker process stays on its core, the rest floats
            repin([t for t in threads if not t.name.startswith("VLLM::Worker")
                   and not _in_worker(t.pid)], all_cores)
            repin([t for t in threads if _in_worker(t.pid)], own)
        moved[engine["role"]] = len(threads)
    return moved


def _in_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().startswith("VLLM::Worker")
    except OSError:
        return False


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = Prompts(args.model, seed=args.seed)
    await wait_ports_free([args.port, args.engine_base_port, args.engine_base_port + 1])
    log(f"starting pdserve dev --model {args.model} ...")
    stack = start_dev(
        log_dir=ROOT / ".pdserve" / "bench-isolation", port=args.port,
        engine_base_port=args.engine_base_port,
        side_channel_base_port=args.side_channel_base_port,
        kv_events_base_port=args.kv_events_base_port, model=args.model, policy="local",
        extra=["--probe-tokens", "", "--reprobe-s", "0"])
    model = "SmolLM2-135M-Instruct" if args.model == "smollm2" else "pdserve-tiny"
    windows: list[tuple[str, str, float, float]] = []  # (arm, kind, start, end)
    prefill_s: dict[str, list[float]] = {"tree": [], "compute": []}
    try:
        async with aiohttp.ClientSession(headers=stack.engine_headers) as session:
            stop = asyncio.Event()

            async def stream(i: int) -> list[float]:
                times: list[float] = []
                while not stop.is_set():  # restart when one ends: streams run throughout
                    t = await timed_stream(session, stack.decode_url + "/v1/chat/completions", {
                        "model": model, "messages": [{"role": "user",
                                                      "content": f"Tell story number {i}."}],
                        "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True})
                    times += t.content_times + [float("nan")]  # nan: a new stream starts
                return times

            streams = [asyncio.create_task(stream(i)) for i in range(args.streams)]
            await asyncio.sleep(5.0)
            for r in range(args.rounds):
                arms = ["tree", "compute"]
                rng.shuffle(arms)
                for arm in arms:
                    place(stack, arm)
                    await asyncio.sleep(0.5)
                    t0 = time.perf_counter()
                    await asyncio.sleep(args.rest_s)
                    windows.append((arm, "rest", t0, time.perf_counter()))
                    body = {"model": model, "messages": prompts.messages(args.prefill_tokens),
                            "max_tokens": 1, "temperature": 0}
                    t0 = time.perf_counter()
                    reply = await timed_post(session, stack.prefill_url + "/v1/chat/completions",
                                             body)
                    t1 = time.perf_counter()
                    windows.append((arm, "prefill", t0, t1))
                    prefill_s[arm].append(reply.elapsed_s)
                    log(f"round {r + 1}/{args.rounds} {arm:7s}: prefill {reply.elapsed_s:.2f}s")
            stop.set()
            times = await asyncio.gather(*streams)
    finally:
        place(stack, "tree")
        stack.stop()
    gaps: dict[tuple[str, str], list[float]] = {}
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            if a != a or b != b:  # across a restart
                continue
            for arm, kind, w0, w1 in windows:
                if w0 <= b <= w1:
                    gaps.setdefault((arm, kind), []).append(b - a)
                    break
    out: dict[str, Any] = {"config": vars(args), "arms": {}}
    for arm in ("tree", "compute"):
        rest = summarize(gaps.get((arm, "rest"), []), 1e3)
        during = summarize(gaps.get((arm, "prefill"), []), 1e3)
        out["arms"][arm] = {"gap_ms_at_rest": rest, "gap_ms_during_prefill": during,
                            "p99_ratio": (during["p99"] / rest["p99"]) if rest.get("n") and
                            during.get("n") else None,
                            "prefill_s": summarize(prefill_s[arm])}
        log(f"{arm:7s}: gap p50/p99/max at rest {rest.get('p50', 0):.0f}/{rest.get('p99', 0):.0f}/"
            f"{rest.get('max', 0):.0f} ms, during prefills {during.get('p50', 0):.0f}/"
            f"{during.get('p99', 0):.0f}/{during.get('max', 0):.0f} ms, p99 ratio "
            f"{out['arms'][arm]['p99_ratio']:.2f} (target <= {TARGET_RATIO}); prefill p50 "
            f"{summarize(prefill_s[arm]).get('p50', 0):.2f}s")
    out["raw"] = {f"{a}/{k}": v for (a, k), v in gaps.items()}
    return out


def plot(results: dict[str, Any]):
    def draw(fig) -> None:
        ax = fig.add_subplot(1, 1, 1)
        labels, data = [], []
        for key in ("tree/rest", "tree/prefill", "compute/rest", "compute/prefill"):
            labels.append(key)
            data.append([g * 1e3 for g in results["raw"].get(key, [])] or [0])
        ax.boxplot(data, tick_labels=labels, whis=(1, 99))
        ax.set_yscale("log")
        ax.set_ylabel("gap between tokens (ms)")
        ax.set_title("streams on the decode engine, at rest and while the prefill engine "
                     "prefills")
    return draw


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    results = asyncio.run(run(args))
    json_path, png_path = save_results(args.name, results, plot(results))
    log(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

