"""Hand-overs on one node through the real engines, per UCX transport list (issue 18, item 3): what
``cma`` beside ``tcp`` (pdserve's default since dd95e11) gives a user over ``tcp`` alone.

Per round and arm (shuffled, so the arms interleave): ``pdserve dev`` started with the arm's
``UCX_TLS`` (``--model``, always disaggregating, no probes), one warm-up request, then
``--requests`` streamed chat requests of ``--prompt-tokens`` fresh tokens each (max_tokens 1),
one at a time, through the proxy. Per request: the client's time to first token, and from the
decode engine's own metrics the NIXL bytes it read and the time its transfers took
(``vllm:nixl_bytes_transferred``, ``vllm:nixl_xfer_time_seconds``). Reported per arm: NIXL GB/s
and TTFT (median and range over every request of every round), and each round's median ratio to
the first arm, so the spread of the ratio shows.

Run: ``python -m benchmarks.kv_transport`` (``--help``). Writes
``benchmarks/results/kv_transport.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from typing import Any

import aiohttp

from benchmarks.common import (
    ROOT,
    Prompts,
    exit_on_sigterm,
    log,
    metric_delta,
    save_results,
    scrape,
    summarize,
    timed_stream,
    wait_ports_free,
)
from harness.stack import start_dev

XFER, BYTES = "vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred"
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "tiny": "pdserve-tiny"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_transport", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", default=["tcp,self", "tcp,cma,self"],
                   help="UCX_TLS values; the first is the baseline of the ratios")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=1800)
    p.add_argument("--port", type=int, default=28000)
    p.add_argument("--engine-base-port", type=int, default=28100)
    p.add_argument("--side-channel-base-port", type=int, default=25600)
    p.add_argument("--kv-events-base-port", type=int, default=25700)
    p.add_argument("--name", default="kv_transport")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


async def one_arm(args: argparse.Namespace, prompts: Prompts, tls: str, label: str
                  ) -> list[dict[str, float]]:
    """One stack with ``UCX_TLS=tls``: the timed requests' rows."""
    await wait_ports_free([args.port, args.engine_base_port, args.engine_base_port + 1])
    stack = start_dev(
        log_dir=ROOT / ".pdserve" / "bench-kv-transport", port=args.port,
        engine_base_port=args.engine_base_port,
        side_channel_base_port=args.side_channel_base_port,
        kv_events_base_port=args.kv_events_base_port, model=args.model, policy="disaggregate",
        extra=["--probe-tokens", "", "--reprobe-s", "0"], env={"UCX_TLS": tls})
    rows = []
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(args.requests + 1):  # the first one warms up
                body = {"model": MODEL_NAMES.get(args.model, args.model), "max_tokens": 1,
                        "messages": prompts.messages(args.prompt_tokens), "temperature": 0,
                        "stream": True}
                before = await scrape(session, stack.decode_url)
                t = await timed_stream(session, stack.proxy_url + "/v1/chat/completions", body)
                if t.status != 200 or t.headers.get("x-pd-route") != "disaggregated":
                    raise RuntimeError(f"{label}: {t.status} {t.headers.get('x-pd-route')} "
                                       f"{t.error}")
                for _ in range(100):  # the engine's metrics land just after the reply
                    after = await scrape(session, stack.decode_url)
                    if (metric_delta(before, after, XFER + "_count") or 0) >= 1:
                        break
                    await asyncio.sleep(0.02)
                nixl_s = metric_delta(before, after, XFER + "_sum") or 0.0
                nbytes = metric_delta(before, after, BYTES + "_sum") or 0.0
                if i:
                    rows.append({"ttft_s": t.ttft_s, "nixl_s": nixl_s, "bytes": nbytes,
                                 "gbps": nbytes / nixl_s / 1e9 if nixl_s else float("nan")})
    finally:
        stack.stop()
    return rows


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = Prompts(args.model, seed=args.seed)
    labels = {tls: f"arm{i}" for i, tls in enumerate(args.arms)}
    rounds: list[dict[str, list[dict[str, float]]]] = []
    for r in range(args.rounds):
        order = list(args.arms)
        rng.shuffle(order)
        this: dict[str, list[dict[str, float]]] = {}
        for tls in order:
            this[tls] = await one_arm(args, prompts, tls, labels[tls])
            log(f"round {r + 1}/{args.rounds} UCX_TLS={tls:14s} NIXL p50 "
                f"{statistics.median(x['gbps'] for x in this[tls]):.2f} GB/s, TTFT p50 "
                f"{statistics.median(x['ttft_s'] for x in this[tls]) * 1e3:.0f} ms, "
                f"{statistics.median(x['bytes'] for x in this[tls]) / 1e6:.0f} MB a request")
        rounds.append(this)
    base = args.arms[0]
    arms: dict[str, Any] = {}
    for tls in args.arms:
        every = [x for rnd in rounds for x in rnd[tls]]

        def ratio(key: str, rnd: dict[str, list[dict[str, float]]], tls: str = tls) -> float:
            return (statistics.median(x[key] for x in rnd[tls])
                    / statistics.median(x[key] for x in rnd[base]))

        arms[tls] = {"nixl_gbps": summarize(x["gbps"] for x in every),
                     "ttft_ms": summarize((x["ttft_s"] for x in every), 1e3),
                     "nixl_ms": summarize((x["nixl_s"] for x in every), 1e3),
                     "mb_per_request": statistics.median(x["bytes"] for x in every) / 1e6,
                     "per_round_gbps_ratio": [ratio("gbps", rnd) for rnd in rounds],
                     "per_round_ttft_ratio": [ratio("ttft_s", rnd) for rnd in rounds]}
    print(f"\n{'UCX_TLS':16}{'NIXL GB/s p50 [min-max]':28}{'TTFT ms p50 [min-max]':28}"
          f"ratios to {base} per round (GB/s; TTFT)")
    for tls, a in arms.items():
        g, t = a["nixl_gbps"], a["ttft_ms"]
        print(f"{tls:16}{g['p50']:.2f} [{g['min']:.2f}-{g['max']:.2f}]".ljust(44)
              + f"{t['p50']:.0f} [{t['min']:.0f}-{t['max']:.0f}]".ljust(28)
              + ", ".join(f"{x:.2f}" for x in a["per_round_gbps_ratio"]) + "; "
              + ", ".join(f"{x:.2f}" for x in a["per_round_ttft_ratio"]))
    return {"config": vars(args), "arms": arms, "rounds": rounds}


def plot(results: dict[str, Any]):
    def draw(fig) -> None:
        arms = list(results["arms"])
        for i, (key, label) in enumerate((("gbps", "NIXL read GB/s (decode engine)"),
                                          ("ttft_s", "time to first token, s (client)"))):
            ax = fig.add_subplot(1, 2, i + 1)
            data = [[x[key] for rnd in results["rounds"] for x in rnd[tls]] for tls in arms]
            ax.boxplot(data, tick_labels=[f"UCX_TLS={a}" for a in arms], whis=(0, 100))
            ax.set_ylabel(label)
            ax.set_title(f"{results['config']['prompt_tokens']}-token hand-overs on one node, "
                         f"{results['config']['model']}")
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
