"""How long an arrival stalls the streams decoding beside it, measured against the gap the
proxy predicted for it (``x-pd-estimate``'s ``gap_local`` or ``gap_disaggregated``: the decode
engine's step model).

One ``pdserve dev`` stack (1P+1D, ``--policy local``, or ``disaggregate`` with
``--route disaggregated``). Each round: two long greedy streams decode on the decode engine;
arrivals of several prompt lengths, in a shuffled order, are sent one at a time (streamed, so
the proxy times their steps too). Per arrival: the longest gap the streams saw from its send to
its first token, the gap predicted for it, and their ratio. Local, the gap is a step that
computes a prompt chunk; disaggregated, the steps while its KV comes in. The SLO rule weighs
each route by this prediction; it is judged on ratios near 1 for short and long prompts alike.

Run: ``python -m benchmarks.local_stall [--model smollm2] [--rounds 3] [--route local]``.
Writes ``benchmarks/results/local_stall.json`` (``--name``) and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.busy_decode import estimate
from benchmarks.common import exit_on_sigterm, log, save_results
from harness.prompts import text_of_tokens
from harness.stack import start_dev
from harness.streams import Streams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--route", choices=("local", "disaggregated"), default="local")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sizes", default="32,64,64,128,256,384,512,768,1023,1023",
                   help="arrivals' prompt tokens, each round (shuffled)")
    p.add_argument("--stream-tokens", type=int, default=3000,
                   help="each stream's answer (within --max-model-len; hung up after a round)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=29000)
    p.add_argument("--engine-base-port", type=int, default=29100)
    p.add_argument("--side-channel-base-port", type=int, default=29200)
    p.add_argument("--name", default="local_stall")
    return p.parse_args(argv)


def arrive(stack, prompt: str, route: str = "local") -> dict[str, Any]:
    """One streamed arrival: its sent and first-data times, prompt tokens and estimate."""
    body = {"model": stack.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, t1, tokens = time.perf_counter(), None, None
    with httpx.Client(timeout=300) as c, c.stream(
            "POST", stack.proxy_url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        est = estimate(r.headers.get("x-pd-estimate"))
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            t1 = t1 or time.perf_counter()
            usage = json.loads(line[6:]).get("usage")
            if usage:
                tokens = usage["prompt_tokens"]
    assert t1 is not None and tokens is not None, "no data, or no usage"
    return {"sent": t0, "first": t1, "prompt_tokens": tokens,
            "predicted_gap_s": est.get(f"gap_{route}"), "predicted_ttft_s": est.get(route)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    by_size: dict[int, list[float]] = {}
    for row in rows:
        if row["ratio"] is not None:
            by_size.setdefault(row["prompt_tokens"], []).append(row["ratio"])
    return {str(n): {"n": len(v), "median": statistics.median(v), "min": min(v), "max": max(v)}
            for n, v in sorted(by_size.items())}


def plot(rows: list[dict[str, Any]], route: str):
    def draw(fig) -> None:
        ax = fig.add_subplot(1, 1, 1)
        xs = [r["prompt_tokens"] for r in rows if r["ratio"] is not None]
        ys = [r["ratio"] for r in rows if r["ratio"] is not None]
        ax.scatter(xs, ys, s=14)
        ax.axhline(1.0, color="grey", lw=0.8)
        for bound in (0.75, 1.25):
            ax.axhline(bound, color="grey", lw=0.6, ls=":")
        ax.set_xlabel(f"{route} prompt tokens (beside 2 streams)")
        ax.set_ylabel("streams' worst gap: measured / predicted")
        ax.set_title(f"Stall of a {route} arrival vs the step model")
    return draw


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    rng = random.Random(args.seed)
    sizes = [int(x) for x in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-stall-") as tmp:
        stack = start_dev(args.model, port=args.port, engine_base_port=args.engine_base_port,
                          side_channel_base_port=args.side_channel_base_port,
                          log_dir=Path(tmp),
                          policy="local" if args.route == "local" else "disaggregate",
                          extra=["--kv-cache-gib", "2"],
                          progress=log)
        try:
            seed = 1000 * (args.seed + 1)
            for rnd in range(args.rounds):
                order = rng.sample(sizes, len(sizes))
                streams = Streams(stack, n=2, max_tokens=args.stream_tokens)
                time.sleep(3.0)  # the streams are decoding: their steps are the baseline
                for n in order:
                    seed += 1
                    row = arrive(stack, text_of_tokens(n, seed=seed, model=args.model),
                                 args.route)
                    time.sleep(1.0)  # gaps that end just after the first byte
                    gaps = streams.gaps(row["sent"], row["first"] + 0.5)
                    worst = max(gaps) if gaps else None
                    predicted = row["predicted_gap_s"]
                    row.update(round=rnd, worst_gap_s=worst, gaps_s=gaps,
                               ratio=worst / predicted if worst and predicted else None)
                    rows.append(row)
                    log(f"round {rnd}: {row['prompt_tokens']} tokens, worst gap "
                        f"{worst or 0:.3f} s, predicted {predicted or 0:.3f} s")
                streams.stop()
                time.sleep(2.0)
            costs = httpx.get(stack.proxy_url + "/pd/costs", timeout=10).json()
        finally:
            stack.stop()
    summary = summarize(rows)
    print(f"{'tokens':>7} {'n':>3} {'measured/predicted median [min-max]':>38}")
    for n, s in summary.items():
        print(f"{n:>7} {s['n']:>3} {s['median']:>20.2f} [{s['min']:.2f}-{s['max']:.2f}]")
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    if ratios:
        print(f"all: median {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}-{max(ratios):.2f}] over {len(ratios)} arrivals")
    save_results(args.name, {"config": vars(args), "summary": summary, "arrivals": rows,
                             "decode_steps": costs.get("decode_steps"), "costs": costs},
                 plot(rows, args.route))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
