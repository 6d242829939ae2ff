"""What a short prompt's first token waits for when its decode engine is computing a long
prompt, on each route, measured against the proxy's prediction.

A disaggregated request's KV goes into the decode engine, and its first token comes out, in
that engine's own steps: behind the prompt work queued there, however idle the prefill engine
is. One ``pdserve dev`` stack (1P+1D, ``auto``); each round, routes in a shuffled order (forced
with ``POST /pd/admin/routing``): a short prompt alone, then the same route for a short prompt
sent while a long prompt is being computed on the decode engine (sent ``local`` just before).
Per arm: the measured TTFT, the TTFT the proxy predicted for the route taken (``x-pd-estimate``)
and their ratio; and the link fit's prediction for the short hand-over, before and after (the
waits must not teach it a slower link).

Run: ``python -m benchmarks.busy_decode [--model smollm2] [--rounds 4]``. Writes
``benchmarks/results/busy_decode.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import exit_on_sigterm, log, save_results
from harness.prompts import text_of_tokens
from harness.stack import MODEL_NAMES, start_dev

ROUTES = {"local": "local", "disaggregated": "disaggregate"}  # route -> the policy forcing it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--short", type=int, default=64, help="the arrival's prompt tokens")
    p.add_argument("--long", type=int, default=1024, help="the prompt computed on decode")
    p.add_argument("--lead-s", type=float, default=0.3, help="long prompt's head start")
    p.add_argument("--port", type=int, default=29000)
    p.add_argument("--engine-base-port", type=int, default=29100)
    p.add_argument("--side-channel-base-port", type=int, default=29200)
    return p.parse_args(argv)


def _post(url: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                  headers={"Content-Type": "application/json"})


def estimate(header: str | None) -> dict[str, float]:
    """``x-pd-estimate``'s figures in seconds (``disaggregated=356.2ms; local=...``)."""
    out: dict[str, float] = {}
    for part in (header or "").split(";"):
        key, _, value = part.strip().partition("=")
        if value.endswith("ms"):
            out[key] = float(value[:-2]) / 1e3
    return out


class Client:
    def __init__(self, proxy: str, model: str):
        self.proxy, self.model = proxy, model

    def route(self, route: str) -> None:
        with urllib.request.urlopen(_post(self.proxy + "/pd/admin/routing",
                                          {"policy": ROUTES[route]}), timeout=30) as r:
            r.read()

    def send(self, prompt: str, out: dict[str, Any]) -> None:
        """One streamed 4-token completion; fills ``out`` with its TTFT, route and estimate."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 4, "stream": True,
                "temperature": 0, "ignore_eos": True}
        t0 = time.monotonic()
        with urllib.request.urlopen(_post(self.proxy + "/v1/completions", body),
                                    timeout=600) as resp:
            out["route"] = resp.headers.get("x-pd-route")
            out["estimate"] = estimate(resp.headers.get("x-pd-estimate"))
            for line in resp:
                if line.startswith(b"data:") and "ttft_s" not in out:
                    out["ttft_s"] = time.monotonic() - t0

    def link(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.proxy + "/pd/costs", timeout=30) as r:
            links = json.load(r)["links"]
        return next(iter(links.values()), {})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    rng = random.Random(0)
    seeds = iter(range(10_000, 20_000))
    arms = [f"{route}/{state}" for route in ROUTES for state in ("idle", "busy")]
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    log(f"starting pdserve dev ({args.model})")
    stack = start_dev(args.model, port=args.port, engine_base_port=args.engine_base_port,
                      side_channel_base_port=args.side_channel_base_port,
                      log_dir=Path(tempfile.mkdtemp(prefix="busy_decode-")), policy="auto",
                      progress=log)
    links: dict[str, Any] = {}
    try:
        c = Client(stack.proxy_url, MODEL_NAMES[args.model])
        for route in ROUTES:  # warm: each route once, so the fits have a sample
            c.route(route)
            c.send(text_of_tokens(args.short, next(seeds), args.model), {})
        links["before"] = c.link()
        for r in range(args.rounds):
            order = list(ROUTES)
            rng.shuffle(order)
            for route in order:
                c.route(route)
                alone: dict[str, Any] = {}
                c.send(text_of_tokens(args.short, next(seeds), args.model), alone)
                runs[f"{route}/idle"].append(alone)
                c.route("local")
                long: dict[str, Any] = {}
                t = threading.Thread(target=c.send, args=(
                    text_of_tokens(args.long, next(seeds), args.model), long))
                t.start()
                time.sleep(args.lead_s)
                c.route(route)
                busy: dict[str, Any] = {"long": long}
                c.send(text_of_tokens(args.short, next(seeds), args.model), busy)
                t.join()
                runs[f"{route}/busy"].append(busy)
                log(f"round {r + 1}/{args.rounds} {route}: alone {alone['ttft_s']:.3f} s "
                    f"(predicted {alone['estimate'].get(route, 0):.3f}), behind the long "
                    f"prompt {busy['ttft_s']:.3f} s (predicted "
                    f"{busy['estimate'].get(route, 0):.3f})")
        links["after"] = c.link()
    finally:
        stack.stop()

    summary: dict[str, Any] = {}
    for arm, xs in runs.items():
        route = arm.split("/")[0]
        measured = [x["ttft_s"] for x in xs]
        ratios = [x["ttft_s"] / x["estimate"][route] for x in xs if x["estimate"].get(route)]
        summary[arm] = {
            "ttft_s_median": statistics.median(measured), "ttft_s_min": min(measured),
            "ttft_s_max": max(measured),
            "predicted_s_median": statistics.median(x["estimate"].get(route, 0) for x in xs),
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None)}
        s = summary[arm]
        log(f"{arm:20s}: TTFT {s['ttft_s_median']:.3f} s [{s['ttft_s_min']:.3f}-"
            f"{s['ttft_s_max']:.3f}], predicted {s['predicted_s_median']:.3f} s, measured/"
            f"predicted {s['ratio_median']:.2f} [{s['ratio_min']:.2f}-{s['ratio_max']:.2f}]")
    log(f"link fit: {links.get('before')} -> {links.get('after')}")

    def draw(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        xs = range(len(arms))
        ax.bar([x - 0.2 for x in xs], [summary[a]["ttft_s_median"] for a in arms], 0.4,
               yerr=[[summary[a]["ttft_s_median"] - summary[a]["ttft_s_min"] for a in arms],
                     [summary[a]["ttft_s_max"] - summary[a]["ttft_s_median"] for a in arms]],
               capsize=3, label="measured (median, min-max)")
        ax.bar([x + 0.2 for x in xs], [summary[a]["predicted_s_median"] for a in arms], 0.4,
               label="predicted (median)")
        ax.set_xticks(list(xs), arms)
        ax.set_ylabel("TTFT of a short prompt (s)")
        ax.set_title(f"{args.model}: {args.short} tokens, decode engine idle or computing "
                     f"{args.long} ({args.rounds} rounds)")
        ax.legend(fontsize=8)

    save_results("busy_decode", {"config": vars(args), "runs": runs, "summary": summary,
                                 "link_fit": links}, draw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
