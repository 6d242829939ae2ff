"""Sweep link rate x prompt length on the throttled testbed: does `auto` pick the faster route?

Each cell: a fresh document of N tokens cached on the prefill engine only (the case where moving
KV competes with recomputing it), then (1) one request through the proxy under `--policy auto`
(its choice and prediction), (2) both routes measured directly on the engines (best of
``--repeats``). Policies are scored on the same direct measurements: `auto` (the proxy's
choices), `disaggregate`, `local` and every `threshold:N` (the best single N is reported).

With ``--two-nodes`` the same sweep runs on Ray across two nodes (``launch/netns_cluster.py``):
the head in the root namespace with the decode engine, a worker node in a network namespace with
the prefill engine, the shaped veth between them; ``pdserve ray --prefill-on --decode-on``. Each
rate also records the proxy's link fit against the rate the decode engine's own NIXL metrics
measured over the same probes.

Writes benchmarks/results/load_or_recompute[_two_nodes].{json,png}. Needs root (network
namespaces).
    python -m benchmarks.load_or_recompute [--rates 10,30,100,300,0] [--lengths 256,512,1024,2048]
        [--two-nodes]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

from harness.routes import costs, run_case, wait_for
from harness.stack import start_dev, start_ray
from launch.netns_cluster import NetnsRayCluster
from launch.testbed import LinkSpec, ThrottledLink
from transport.cost import LinkModel, PrefillModel, crossover_tokens

RESULTS = Path(__file__).parent / "results"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rate_label(rate: float) -> str:
    return "unthrottled" if not rate else f"{rate:g} Mbit/s"


def wait_for_link_estimate(stack, rate_mbit: float) -> dict:
    """Let the proxy's re-probes measure the new rate before the cell's request is decided."""
    target = rate_mbit * 1e6 / 8 if rate_mbit else None

    def settled() -> bool:
        links = costs(stack)["links"]
        if not links:
            return False
        bw = min(v["bytes_per_s"] for v in links.values())
        return bw > 40e6 if target is None else 0.4 * target < bw < 2.5 * target

    wait_for(settled, f"link estimate for {rate_label(rate_mbit)}", timeout_s=120)
    return costs(stack)


def nixl_totals(stack) -> tuple[float, float]:
    """The decode engine's own NIXL counters: (bytes, seconds transferring)."""
    text = httpx.get(stack.decode_url + "/metrics", timeout=10).text
    got = dict.fromkeys(("vllm:nixl_bytes_transferred_sum", "vllm:nixl_xfer_time_seconds_sum"),
                        0.0)
    for line in text.splitlines():
        key = line.split("{", 1)[0]
        if key in got:
            got[key] += float(line.rsplit(" ", 1)[1])
    return got["vllm:nixl_bytes_transferred_sum"], got["vllm:nixl_xfer_time_seconds_sum"]


def nixl_rate(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """Mbit/s over the transfers between two readings (None without any)."""
    nbytes, seconds = after[0] - before[0], after[1] - before[1]
    return nbytes * 8 / 1e6 / seconds if seconds > 0 else None


def predicted_crossover(snapshot: dict, kvb: int) -> int | None:
    """Crossover from the live fits: remote prefill of a cached doc ~ free, vs local recompute."""
    link = LinkModel(**{k: v for k, v in next(iter(snapshot["links"].values())).items()
                        if k in ("fixed_s", "bytes_per_s")})
    local_fit = next(iter(snapshot["local_prefill"].values()))
    local = PrefillModel(local_fit["fixed_s"], local_fit["tokens_per_s"], local_fit["quad_s"])
    free = PrefillModel(0.0, 1e12)
    return crossover_tokens(kvb, link, free, local, max_tokens=1 << 16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="10,30,100,300,0", help="Mbit/s; 0 = unthrottled")
    ap.add_argument("--lengths", default="256,512,1024,2048")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--port", type=int, default=29000)
    ap.add_argument("--reprobe-s", type=float, default=1.0,
                    help="the proxy's link re-probe period (a probe that outlasts it overlaps "
                         "the next one on a slow link)")
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="after the link estimate is in range, keep re-probing this long "
                         "(recording the fit each second) before the cells")
    ap.add_argument("--two-nodes", action="store_true",
                    help="Ray, prefill on a worker node in a netns, decode on the head")
    args = ap.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "load_or_recompute_two_nodes" if args.two_nodes else "load_or_recompute"
    log_dir = Path(f"/tmp/pdserve-bench-{name}")
    probes = ["--reprobe-s", f"{args.reprobe_s:g}", "--probe-tokens", "64,512,1536"]
    cluster = None
    if args.two_nodes:
        cluster = NetnsRayCluster(ThrottledLink("pdnode", 232), head_resource="pd_decode",
                                  worker_resource="pd_prefill").start()
        log(f"two Ray nodes: head {cluster.link.host_addr}, worker {cluster.link.ns_addr} "
            f"in netns {cluster.link.netns}; starting pdserve ray (logs in {log_dir}) ...")
        try:
            stack = start_ray("tiny", port=args.port, log_dir=log_dir, env=cluster.auth_env,
                              extra=["--address", cluster.address, "--namespace", "lor",
                                     "--prefill", "1", "--decode", "1", "--prefill-on",
                                     "pd_prefill", "--decode-on", "pd_decode", "--policy",
                                     "auto", "--engine-dev-endpoints", *probes])
        except BaseException:
            cluster.stop()
            raise
        urls = {e["role"]: e["url"] for e in stack.engines().values()}
        stack.prefill_url, stack.decode_url = urls["prefill"], urls["decode"]
        link = cluster.link
    else:
        log(f"starting the testbed stack (logs in {log_dir}) ...")
        stack = start_dev(
            "tiny", port=args.port, engine_base_port=args.port + 100,
            side_channel_base_port=args.port + 600, log_dir=log_dir, model_name="pdserve-tiny",
            extra=["--policy", "auto", "--link-mbit", "0", "--kv-events-base-port",
                   str(args.port + 700), "--engine-dev-endpoints", *probes],
        )
        stack.prefill_url = stack.run_info()["engines"][0]["url"]
        link = ThrottledLink.attach()
    cells = []
    crossovers = []
    try:
        for rate in rates:
            link.set_rate(LinkSpec(rate or None))
            nixl_before = nixl_totals(stack)
            t_rate = time.monotonic()
            snapshot = wait_for_link_estimate(stack, rate)
            trace = []
            while time.monotonic() < t_rate + args.settle_s:
                fit = next(iter(costs(stack)["links"].values()))
                trace.append([round(time.monotonic() - t_rate, 1),
                              fit["bytes_per_s"] * 8 / 1e6, fit["fixed_s"] * 1e3])
                time.sleep(1.0)
            kvb = snapshot["kv_bytes_per_token"]
            measured_cross = None
            for i, n in enumerate(lengths):
                t0 = time.monotonic()
                case = run_case(stack, n, seed=int(rate * 1000) + i, repeats=args.repeats)
                case.update(rate_mbit=rate, tokens=n)
                cells.append(case)
                best = min(case["local"], case["disaggregated"])
                if measured_cross is None and case["disaggregated"] < case["local"]:
                    measured_cross = n
                log(f"{rate_label(rate):>12} {n:5d} tok: auto={case['route']:<13} "
                    f"local={case['local'] * 1e3:7.1f}ms "
                    f"disagg={case['disaggregated'] * 1e3:7.1f}ms"
                    f" chosen/best={case[_key(case['route'])] / best:.2f}"
                    f" ({time.monotonic() - t0:.0f}s)")
            after = costs(stack)
            fit = next(iter(after["links"].values()))
            nixl = nixl_rate(nixl_before, nixl_totals(stack))
            crossovers.append({"rate_mbit": rate,
                               "measured_first_disaggregated_length": measured_cross,
                               "predicted_crossover_tokens": predicted_crossover(after, kvb),
                               "fit_mbit": fit["bytes_per_s"] * 8 / 1e6,
                               "fit_fixed_ms": fit["fixed_s"] * 1e3,
                               "nixl_mbit": nixl,
                               "fit_trace_s_mbit_fixed_ms": trace})
            log(f"{rate_label(rate):>12}: link fit {fit['bytes_per_s'] * 8 / 1e6:.1f} Mbit/s + "
                f"{fit['fixed_s'] * 1e3:.1f} ms; the decode engine's NIXL metrics: "
                f"{nixl if nixl is None else round(nixl, 1)} Mbit/s")
    finally:
        link.set_rate(LinkSpec(None))
        stack.stop()
        if cluster is not None:
            cluster.stop()
    summary = score(cells, lengths)
    summary["crossovers"] = crossovers
    out = {"cells": cells, "summary": summary, "rates_mbit": rates, "lengths": lengths,
           "machine": {"node": platform.node(), "python": platform.python_version()},
           "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out["layout"] = "ray, two nodes (netns worker)" if args.two_nodes else "dev (netns prefill)"
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2))
    plot(cells, rates, lengths, RESULTS / f"{name}.png")
    print_summary(summary)
    return 0


def _key(route: str) -> str:
    return "disaggregated" if route == "disaggregated" else "local"


def score(cells: list[dict], lengths: list[int]) -> dict:
    def ttft(cell: dict, route: str) -> float:
        return cell[_key(route)]

    best = [min(c["local"], c["disaggregated"]) for c in cells]
    auto = [ttft(c, c["route"]) for c in cells]
    policies = {
        "auto": auto,
        "disaggregate": [c["disaggregated"] for c in cells],
        "local": [c["local"] for c in cells],
    }
    thresholds = {}
    for n in [0, *lengths, max(lengths) + 1]:
        thresholds[n] = [c["disaggregated"] if c["tokens"] >= n else c["local"] for c in cells]
    best_n = min(thresholds, key=lambda n: statistics.mean(thresholds[n]))
    policies[f"threshold:{best_n}"] = thresholds[best_n]
    regret = [a / b - 1 for a, b in zip(auto, best)]
    return {
        "cells": len(cells),
        "within_10pct_of_best": sum(r <= 0.10 for r in regret) / len(cells),
        "mean_regret": statistics.mean(regret),
        "mean_ttft_s": {k: statistics.mean(v) for k, v in policies.items()},
        "oracle_mean_ttft_s": statistics.mean(best),
        "best_threshold": best_n,
        "auto_matches_oracle": sum(
            (c["route"] == "disaggregated") == (c["disaggregated"] < c["local"]) for c in cells
        ) / len(cells),
    }


def print_summary(s: dict) -> None:
    print(f"cells: {s['cells']}; auto within 10% of the better route in "
          f"{s['within_10pct_of_best']:.0%}; mean regret {s['mean_regret']:.1%}; "
          f"auto picked the oracle's route in {s['auto_matches_oracle']:.0%}")
    auto = s["mean_ttft_s"]["auto"]
    for name, v in sorted(s["mean_ttft_s"].items(), key=lambda kv: kv[1]):
        print(f"  {name:<18} mean TTFT {v * 1e3:8.1f} ms   ({v / auto:.2f}x auto)")
    print(f"  {'oracle':<18} mean TTFT {s['oracle_mean_ttft_s'] * 1e3:8.1f} ms")
    for c in s["crossovers"]:
        print(f"  {rate_label(c['rate_mbit']):>12}: measured crossover at "
              f"{c['measured_first_disaggregated_length']} tokens (first length where "
              f"disaggregated won), predicted {c['predicted_crossover_tokens']}")


def plot(cells: list[dict], rates: list[float], lengths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    gain = np.zeros((len(rates), len(lengths)))
    marks = {}
    for c in cells:
        i, j = rates.index(c["rate_mbit"]), lengths.index(c["tokens"])
        gain[i, j] = np.log2(c["local"] / c["disaggregated"])
        marks[(i, j)] = "D" if c["route"] == "disaggregated" else "L"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lim = max(1.0, float(np.abs(gain).max()))
    im = ax.imshow(gain, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    for (i, j), m in marks.items():
        right = (m == "D") == (gain[i, j] > 0)
        ax.text(j, i, m, ha="center", va="center", fontsize=13, fontweight="bold",
                color="black" if right else "magenta")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(rates)), [rate_label(r) for r in rates])
    ax.set_xlabel("document tokens (cached on prefill only)")
    ax.set_ylabel("prefill->decode link")
    ax.set_title("auto's choice (D/L; magenta = wrong) over log2(local/disaggregated TTFT)")
    fig.colorbar(im, ax=ax, label="blue: moving KV faster; red: recompute faster")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
