"""The host-memory offload tier: what an evicted prefix costs with and without it, and how LRU
and ARC hold up at the tier's capacity.

1. Seed experiment (per model, one stack with the tier, engine KV cache capped so that three
   other documents evict a document): TTFT of A cold, A again (engine cache hit), and, after
   eviction, A restored from the tier vs A recomputed. The two post-eviction arms run on the
   same engine in alternating order; "recomputed" is the same request with
   ``kv_limits: {"load_tiers": []}`` (the tier may not be read), so nothing else differs.
2. Capacity cliff (tiny model, a tier of ``--cliff-chunks`` chunks): a cyclic scan over a working
   set slightly larger than the tier, and a skewed (Zipf) workload over more documents, under
   ``lru`` and ``arc``. Reported: the share of prompt tokens each source served (engine cache,
   tier, computed), from the decode engine's own metrics.

    python -m benchmarks.offload_tier [--models tiny,smollm2] [--reps 3]

Writes benchmarks/results/offload_tier.{json,png}.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from benchmarks.common import log, save_results
from harness.engine_io import prompt_sources
from harness.prompts import text_of_tokens
from harness.routes import ttft_stream
from harness.stack import start_dev

BLOCK = 128
KV_BLOCKS = 24
DOC_BLOCKS = 12  # 1536 cached tokens (+60): a >= 1.5k-token prefix
SOURCES = ("local_cache_hit", "external_kv_transfer", "local_compute")


def start(model: str, port: int, offload: list[str], log_dir: Path):
    name = {"tiny": "pdserve-tiny", "smollm2": "SmolLM2-135M-Instruct"}[model]
    return start_dev(
        model, port=port, engine_base_port=port + 100, side_channel_base_port=port + 600,
        log_dir=log_dir, model_name=name,
        extra=["--policy", "local", "--kv-events-base-port", str(port + 700), "--kv-blocks",
               str(KV_BLOCKS), "--max-model-len", "2048", "--probe-tokens", "", *offload])


def request(stack, model: str, seed: int, n_tokens: int, **extra) -> tuple[float, dict]:
    body = {"model": stack.model_name, "prompt": text_of_tokens(n_tokens, seed=seed, model=model),
            "max_tokens": 1, "temperature": 0, **extra}
    before = prompt_sources(stack.decode_url)
    with httpx.Client(timeout=600) as c:
        ttft, _ = ttft_stream(c, stack.proxy_url + "/v1/completions", body)
    after = prompt_sources(stack.decode_url)
    return ttft, {k: after.get(k, 0) - before.get(k, 0) for k in SOURCES}


def seed_experiment(model: str, reps: int, port: int) -> dict:
    n = DOC_BLOCKS * BLOCK + 60
    log(f"[seed/{model}] starting a stack with a 0.5 GiB tier, {KV_BLOCKS}-block engine cache")
    stack = start(model, port, ["--offload-gib", "0.5"], Path(f"/tmp/pdserve-bench-tier-{model}"))
    rows = []
    seed = 1000
    try:
        for rep in range(reps):
            a = seed = seed + 1

            def evict() -> None:
                nonlocal seed
                for _ in range(3):  # 36 blocks of other documents: none of A stays
                    seed += 1
                    request(stack, model, seed, n)

            row = {"rep": rep}
            row["cold"], row["cold_src"] = request(stack, model, a, n)
            row["engine_hit"], row["engine_hit_src"] = request(stack, model, a, n)
            order = ("tier", "recompute") if rep % 2 == 0 else ("recompute", "tier")
            for arm in order:
                evict()
                extra = {"kv_limits": {"load_tiers": []}} if arm == "recompute" else {}
                row[arm], row[arm + "_src"] = request(stack, model, a, n, **extra)
            rows.append(row)
            log(f"[seed/{model}] rep {rep}: cold {row['cold'] * 1e3:.0f} ms, engine hit "
                f"{row['engine_hit'] * 1e3:.0f} ms, from tier {row['tier'] * 1e3:.0f} ms "
                f"({row['tier_src']['external_kv_transfer']:.0f} tokens from the tier), "
                f"recomputed {row['recompute'] * 1e3:.0f} ms")
    finally:
        stack.stop()
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("cold", "engine_hit", "tier", "recompute")}
    return {"model": model, "prompt_tokens": n, "cached_tokens": DOC_BLOCKS * BLOCK,
            "rows": rows, "median_s": med,
            "recompute_over_tier": med["recompute"] / med["tier"]}


def cliff(policy: str, chunks: int, port: int) -> dict:
    """Tier of ``chunks`` chunks (one 128-token block each, 512 KiB for the tiny model)."""
    gib = chunks * BLOCK * 4096 / 2**30
    log(f"[cliff/{policy}] starting a stack with a {chunks}-chunk tier ({gib * 1024:.0f} MiB)")
    stack = start("tiny", port, ["--offload-gib", f"{gib:.6f}", "--offload-eviction", policy],
                  Path(f"/tmp/pdserve-bench-cliff-{policy}"))
    n = 8 * BLOCK + 60  # 8 blocks per document
    docs_cyclic = chunks // 8 + 1  # working set one document larger than the tier
    out = {}
    try:
        rng = random.Random(7)
        workloads = {
            "cyclic": [2000 + i % docs_cyclic for i in range(docs_cyclic * 8)],
            "zipf": [3000 + z for z in _zipf(rng, 3 * docs_cyclic, 1.1, docs_cyclic * 8)],
        }
        for name, seeds in workloads.items():
            totals = dict.fromkeys(SOURCES, 0.0)
            for i, s in enumerate(seeds):
                _, src = request(stack, "tiny", s, n)
                if i >= len(seeds) // 4:  # the first quarter warms the caches
                    for k in SOURCES:
                        totals[k] += src[k]
            all_tokens = sum(totals.values())
            out[name] = {k: v / all_tokens for k, v in totals.items()}
            out[name]["requests"] = len(seeds)
            out[name]["documents"] = len(set(seeds))
            log(f"[cliff/{policy}] {name}: tier served {out[name]['external_kv_transfer']:.0%}, "
                f"engine cache {out[name]['local_cache_hit']:.0%}, computed "
                f"{out[name]['local_compute']:.0%} of prompt tokens")
    finally:
        stack.stop()
    return {"policy": policy, "tier_chunks": chunks, "workloads": out}


def _zipf(rng: random.Random, n_items: int, s: float, k: int) -> list[int]:
    weights = [1 / (i + 1) ** s for i in range(n_items)]
    return rng.choices(range(n_items), weights=weights, k=k)


def plot(fig, seeds: list[dict], cliffs: list[dict]) -> None:
    ax1 = fig.add_subplot(1, 2, 1)
    arms = ("cold", "engine_hit", "tier", "recompute")
    width = 0.8 / max(1, len(seeds))
    for i, s in enumerate(seeds):
        xs = [j + i * width for j in range(len(arms))]
        ax1.bar(xs, [s["median_s"][a] * 1e3 for a in arms], width, label=s["model"])
    ax1.set_xticks([j + width * (len(seeds) - 1) / 2 for j in range(len(arms))],
                   ["A cold", "A again\n(engine)", "evicted A\nfrom tier",
                    "evicted A\nrecomputed"])
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT, median (ms, log)")
    ax1.set_title(f"seed experiment ({DOC_BLOCKS * BLOCK + 60}-token prompt)")
    ax1.legend()
    ax2 = fig.add_subplot(1, 2, 2)
    labels, tier, engine = [], [], []
    for c in cliffs:
        for w, v in c["workloads"].items():
            labels.append(f"{c['policy']}\n{w}")
            tier.append(v["external_kv_transfer"])
            engine.append(v["local_cache_hit"])
    ax2.bar(labels, engine, label="engine cache")
    ax2.bar(labels, tier, bottom=engine, label="offload tier")
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("share of prompt tokens not computed")
    ax2.set_title(f"capacity cliff: tier of {cliffs[0]['tier_chunks'] if cliffs else '?'} "
                  "chunks, cyclic scan one document larger vs Zipf")
    ax2.legend()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cliff-chunks", type=int, default=40)
    ap.add_argument("--port", type=int, default=27000)
    args = ap.parse_args()
    t0 = time.monotonic()
    seeds = [seed_experiment(m, args.reps, args.port) for m in args.models.split(",") if m]
    cliffs = [cliff(p, args.cliff_chunks, args.port) for p in ("lru", "arc")]
    payload = {"args": vars(args), "seed_experiment": seeds, "capacity_cliff": cliffs,
               "duration_s": time.monotonic() - t0}
    json_path, png_path = save_results("offload_tier", payload,
                                       lambda fig: plot(fig, seeds, cliffs))
    for s in seeds:
        m = s["median_s"]
        print(f"{s['model']:>8} ({s['prompt_tokens']} tokens): cold {m['cold'] * 1e3:.0f} ms, "
              f"engine hit {m['engine_hit'] * 1e3:.0f} ms, evicted+tier {m['tier'] * 1e3:.0f} ms,"
              f" evicted+recompute {m['recompute'] * 1e3:.0f} ms -> tier is "
              f"{s['recompute_over_tier']:.1f}x faster than recompute (target >= 2x)")
    for c in cliffs:
        for w, v in c["workloads"].items():
            print(f"{c['policy']:>4} {w:>6}: tier {v['external_kv_transfer']:.0%}, engine "
                  f"{v['local_cache_hit']:.0%}, computed {v['local_compute']:.0%}")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
