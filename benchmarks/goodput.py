"""When does disaggregation pay? Goodput of each way to run two engines, under vLLM's own load
generator (``vllm.benchmarks.serve``, the code behind ``vllm bench serve``).

One ``pdserve dev --layout pool`` stack per model: two engines that may each prefill or decode
(vLLM's ``kv_both``). The arms are routings of those same two engines, switched at run time
(``POST /pd/admin/routing``), so they interleave within a run instead of waiting for restarts:

- ``aggregated``: both engines serve whole requests (least outstanding work, cached prefix);
- ``disaggregated``: 1P+1D, engine-0 prefills, engine-1 decodes, every request moves its KV;
- ``threshold``: 1P+1D with the llm-d/Dynamo rule at its best N for the workload (for a
  workload of one prompt length every N is "always" or "never"; see ``THRESHOLD``);
- ``auto``: 1P+1D with pdserve's cost model, the arriving request's TTFT alone;
- ``slo``: 1P+1D with ``auto`` given the run's targets (each request carries them as its
  ``slo``; for the mixed workload only the ITL target, its TTFT targets differing per prompt
  length): it also weighs the stall a local prefill puts on the streams decoding there;
- ``slo_ttft``: ``slo`` with each request carrying both targets of its own prompt length (the
  TTFT target too, on the mixed workload: what a client that knows its targets per request
  class sends; ``with_own_targets``);
- ``slo_pool``: the same rule on the pool, where both engines prefill and decode and the
  policy picks the pair per request;
- any arm given with ``--extra-arm name=policy[@pool]``.

Workloads: ``prefill_heavy`` (random 1024 in / 32 out), ``decode_heavy`` (random 128 in / 256
out) and ``mixed`` (half 1024-token prompts with 16-token answers, half 64-token prompts with
256-token answers: long answers streaming while long prompts arrive), Poisson arrivals.

A request is **good** when its TTFT is within the TTFT target of its prompt length and the
**p99 of its own gaps between tokens** is within the ITL target (vLLM's ``--goodput`` uses the
mean TPOT, which hides one long stall inside a long answer: ``is_good``). Targets come from the
start of each run: single requests on an idle ``aggregated`` deployment give the unloaded TTFT
(median, per prompt length) and the unloaded p99 gap (the median over those requests of each
one's own p99: the same statistic goodness judges, so the box's own scheduling noise is in
it); targets are ``--ttft-factor`` x and ``--itl-factor`` x those.

Rates are set from a measured capacity: a burst of ``--requests`` all at once on
``aggregated`` gives requests/s; the sweep runs fractions of it (``--rate-fractions``). Each
point runs every arm once, in a shuffled order, ``--repeats`` times, on the same prompts, each
arm from cold prefix caches (``cold_caches``: else the arm before warms the next). Reported
per arm: SLO attainment against request rate, the highest rate with >= 90 % of requests good
(interpolated; DistServe's figure) for each repeat, and the route mix per rate; per request,
the proxy's decision (``GET /pd/decisions``, joined on the ``x-request-id`` the load generator
sends): route, reason, predicted and measured TTFT, the streams and stall room it saw.

Budget (why the counts are what they are): a point costs ``requests / rate`` seconds per arm;
with fractions f the sweep costs ``B * sum(1/f)`` per arm and repeat, B = the burst's duration.
On this box B is ~2-4 s on the tiny model and ~15-40 s on SmolLM2 (~200 prompt tokens/s per
core), so SmolLM2 gets fewer requests and points (``MODEL_SCALE``). ``--quick``: one workload,
one model, one repeat.

Run: ``python -m benchmarks.goodput [--quick] [--models tiny,smollm2] [--workloads ...]``.
Writes ``benchmarks/results/goodput.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import (
    ROOT,
    exit_on_sigterm,
    log,
    save_results,
    wait_ports_free,
)
from harness.stack import start_dev

GOOD_SHARE = 0.9
SERVED = {"tiny": "pdserve-tiny", "smollm2": "SmolLM2-135M-Instruct"}
#: requests per point and rate fractions per model (SmolLM2 is ~20x slower here).
#: 90 % good needs >= 10 requests a point to allow one miss; a point costs requests/rate s,
#: so the lowest fraction sets the budget (a sweep costs B * sum(1/f) per arm and repeat).
#: Sized from the measured cost of an earlier run (aeac0f3: 66 min with (0.15, 0.4, 0.7, 1.0)
#: and (0.4, 0.7, 1.0); points took tiny 849 s, SmolLM2 2,500 s, start-ups and cache resets
#: ~10 min): sum(1/f) 11.6 -> 6.0 (tiny) and 4.9 -> 3.0 (SmolLM2) predicts ~43 min.
MODEL_SCALE = {"tiny": (32, (0.3, 0.6, 1.0)), "smollm2": (10, (0.5, 1.0))}
WORKLOADS: dict[str, list[tuple[int, int, float]]] = {
    # (prompt tokens, answer tokens, share of requests)
    "prefill_heavy": [(1024, 32, 1.0)],
    "decode_heavy": [(128, 256, 1.0)],
    "mixed": [(1024, 16, 0.5), (64, 256, 0.5)],
}
#: threshold:N per workload: one prompt length -> any N is "always" (= disaggregated) or
#: "never" (= all on the decode engine, dominated by aggregated); two lengths -> N between them
#: (long prompts P/D, short ones local) is the only distinct choice.
THRESHOLD = {"mixed": 512}
POOL = ["engine-0", "engine-1"]


#: Arms whose requests carry the run's targets as their own ``slo`` (the others carry none).
WITH_TARGETS = {"slo", "slo_pool", "slo_ttft"}
#: ... each request its own prompt length's TTFT target as well (on a mix: ``with_own_targets``).
OWN_TTFT_TARGET = {"slo_ttft"}


def arm_routings(workload: str, extra: dict[str, str]) -> dict[str, dict[str, Any]]:
    split = {"prefill": ["engine-0"], "decode": ["engine-1"]}
    arms: dict[str, dict[str, Any]] = {
        "aggregated": {"policy": "local", "prefill": [], "decode": POOL},
        "disaggregated": {"policy": "disaggregate", **split},
        "auto": {"policy": "auto", **split},
        "slo": {"policy": "auto", **split},
        "slo_ttft": {"policy": "auto", **split},
        "slo_pool": {"policy": "auto", "prefill": POOL, "decode": POOL},
    }
    if workload in THRESHOLD:
        arms["threshold"] = {"policy": f"threshold:{THRESHOLD[workload]}", **split}
    for name, spec in extra.items():
        policy, _, where = spec.partition("@")
        arms[name] = ({"policy": policy, "prefill": POOL, "decode": POOL} if where == "pool"
                      else {"policy": policy, **split})
    return arms


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.goodput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--requests", type=int, default=None, help="per point (default per model)")
    p.add_argument("--rate-fractions", default=None, help="of the measured capacity")
    p.add_argument("--ttft-factor", type=float, default=4.0)
    p.add_argument("--itl-factor", type=float, default=3.0)
    p.add_argument("--arms", default=None,
                   help="which arms (default: all): aggregated, disaggregated, threshold, auto, "
                        "slo, slo_ttft, slo_pool and any --extra-arm")
    p.add_argument("--extra-arm", action="append", default=[],
                   help="name=policy or name=policy@pool (both engines prefill and decode)")
    p.add_argument("--quick", action="store_true",
                   help="one workload (prefill_heavy), the tiny model, one repeat")
    p.add_argument("--port", type=int, default=28000)
    p.add_argument("--engine-base-port", type=int, default=28100)
    p.add_argument("--side-channel-base-port", type=int, default=25600)
    p.add_argument("--kv-events-base-port", type=int, default=25700)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="goodput")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.workloads, args.repeats = "tiny", "prefill_heavy", 1
    return args


# --- the load generator -----------------------------------------------------------------------


def bench(base_url: str, model: str, tokenizer: str, workload: str, n: int, rate: float,
          seed: int, data_dir: Path, concurrency: int | None = None,
          slo: dict[str, float] | None = None, request_id_prefix: str | None = None,
          ttft_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """One ``vllm bench serve`` run against the proxy; its result with per-request detail.
    Request i is sent with ``x-request-id: <request_id_prefix>i``. ``ttft_ms`` (TTFT target per
    prompt length): each request's ``slo`` also carries its own (``with_own_targets``)."""
    import vllm.benchmarks.serve as serve
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    mix = WORKLOADS[workload]
    argv = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer, "--num-prompts", str(n),
            "--request-rate", "inf" if math.isinf(rate) else f"{rate:.4f}",
            "--burstiness", "1.0", "--seed", str(seed), "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(data_dir),
            "--result-filename", f"run-{time.monotonic_ns()}.json", "--disable-tqdm"]
    if concurrency:
        argv += ["--max-concurrency", str(concurrency)]
    if slo:
        argv += ["--extra-body", json.dumps({"slo": slo})]
    if request_id_prefix:
        argv += ["--request-id-prefix", request_id_prefix]
    if len(mix) == 1:
        (inp, out, _), = mix
        argv += ["--dataset-name", "random", "--random-input-len", str(inp),
                 "--random-output-len", str(out), "--random-range-ratio", "0.0"]
    else:
        argv += ["--dataset-name", "custom", "--dataset-path",
                 str(mixed_dataset(tokenizer, mix, n, seed, data_dir)),
                 "--custom-output-len", "-1", "--skip-chat-template", "--ignore-eos"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    if not (slo and ttft_ms):
        return bench_main(args)
    # vLLM's own per-request body (``SampleRequest.request_overrides``, merged over
    # --extra-body), set on the requests its loader made.
    sampled = serve.get_samples
    serve.get_samples = lambda *a, **k: with_own_targets(sampled(*a, **k), mix, slo, ttft_ms)
    try:
        return bench_main(args)
    finally:
        serve.get_samples = sampled


def with_own_targets(samples: list[Any], mix, slo: dict[str, float],
                     ttft_ms: dict[str, float]) -> list[Any]:
    """Each of vLLM's sampled requests with an ``slo`` of the run's targets and the TTFT target
    of its own prompt length (``request_class``)."""
    for sample in samples:
        own = ttft_ms[str(request_class(sample.prompt_len, mix))]
        sample.request_overrides = {**(sample.request_overrides or {}),
                                    "slo": {**slo, "ttft_ms": own}}
    return samples


def mixed_dataset(tokenizer: str, mix, n: int, seed: int, data_dir: Path) -> Path:
    """A jsonl of ``n`` prompts in the workload's shares (text of about the given token
    length, random words so no two share a prefix)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    rng = random.Random(seed)
    words = "river stone lantern orbit meadow copper signal harbor velvet thunder".split()
    rows = []
    for inp, out, share in mix:
        for _ in range(round(n * share)):
            ids = tok.encode(" ".join(rng.choice(words) for _ in range(inp)),
                             add_special_tokens=False)[:inp - 1]
            rows.append({"prompt": tok.decode(ids), "output_tokens": out})
    rng.shuffle(rows)
    path = data_dir / f"mixed-{seed}-{n}.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


# --- goodness ---------------------------------------------------------------------------------


def p99(values: list[float]) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)] if xs else 0.0


def request_class(input_len: int, mix) -> int:
    """The workload prompt length this request stands for (its nearest)."""
    return min((inp for inp, _, _ in mix), key=lambda inp: abs(inp - input_len))


def is_good(ttft_s: float, itls_s: list[float], ttft_target_s: float, itl_target_s: float
            ) -> bool:
    """Within the TTFT target, and the p99 of its own gaps within the ITL target: a request
    whose mean gap is fine but which stalled once for longer than the target is not good."""
    return 0 < ttft_s <= ttft_target_s and p99(itls_s) <= itl_target_s


def attainment(result: dict[str, Any], targets: dict[str, Any], mix) -> dict[str, Any]:
    good = failed = 0
    n = len(result.get("ttfts", []))
    for ttft, itls, inp, err in zip(result["ttfts"], result["itls"], result["input_lens"],
                                    result["errors"]):
        if err or not ttft:
            failed += 1
            continue
        cls = str(request_class(inp, mix))
        good += is_good(ttft, itls, targets["ttft_s"][cls], targets["itl_s"])
    return {"requests": n, "good": good, "failed": failed,
            "attainment": good / n if n else 0.0}


def highest_good_rate(points: list[tuple[float, float]]) -> float | None:
    """The highest rate at which >= 90 % of requests were good, interpolated between the
    measured points (sorted by rate); None when even the lowest rate missed."""
    points = sorted(points)
    if not points or points[0][1] < GOOD_SHARE:
        return None
    best = points[0][0]
    for (r0, a0), (r1, a1) in zip(points, points[1:]):
        if a1 >= GOOD_SHARE:
            best = r1
            continue
        if a0 >= GOOD_SHARE:  # crosses between r0 and r1
            best = r0 + (r1 - r0) * (a0 - GOOD_SHARE) / (a0 - a1)
        break
    return best


# --- the run ----------------------------------------------------------------------------------


def set_routing(proxy: str, routing: dict[str, Any]) -> None:
    req = urllib.request.Request(proxy + "/pd/admin/routing", method="POST",
                                 data=json.dumps(routing).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


def decisions(proxy: str, prefix: str, n: int) -> list[dict[str, Any] | None]:
    """The proxy's decision for each of a run's ``n`` requests (``GET /pd/decisions``; the
    first, for a stream migrated to another engine), in request order: route taken, reason,
    predicted and measured TTFT (ms), the streams it was told of and their stall room, and
    both routes' predicted TTFT and gap."""
    url = f"{proxy}/pd/decisions?prefix={prefix}&limit={4 * n}"
    with urllib.request.urlopen(url, timeout=30) as r:
        entries = json.load(r)["decisions"]
    out: list[dict[str, Any] | None] = [None] * n
    for e in reversed(entries):  # oldest first: a request's first decision wins
        i = int(e["request_id"][len(prefix):])
        if 0 <= i < n and out[i] is None:
            route = e["route_taken"] or e["route"]
            out[i] = {"route": route, "reason": e["reason"],
                      "predicted_ms": e["predicted_ttft_ms"][e["route"]],
                      "ttft_ms": e["ttft_ms"], "prompt_tokens": e["prompt_tokens"],
                      "streams": e["streams"], "stall_room": e["stall_room"],
                      "gap_ms": e["predicted_gap_ms"][e["route"]],
                      # Both routes' predictions: why the other one lost.
                      "estimate": {"ttft_ms": e["predicted_ttft_ms"],
                                   "gap_ms": e["predicted_gap_ms"],
                                   "ttft_correction": e.get("ttft_correction")}}
    return out


def proxy_metrics(proxy: str) -> dict[str, float]:
    """Requests per route, decisions per route and reason (``route/reason``), and the
    prediction-ratio histograms' cumulative buckets (``name|route|le``)."""
    with urllib.request.urlopen(proxy + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pd_requests_total{"):
            route = line.split('route="', 1)[1].split('"', 1)[0]
            out[route] = out.get(route, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith(RATIO_HISTOGRAMS):
            name = line.split("_bucket{", 1)[0]
            route = line.split('route="', 1)[1].split('"', 1)[0]
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[f"{name}|{route}|{le}"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pd_decisions_total{"):
            route = line.split('route="', 1)[1].split('"', 1)[0]
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            key = f"{route}/{reason}"
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


#: The proxy's measured / predicted histograms (TTFT, and the streams' worst gap beside an
#: arrival): their medians per point say how well the step and prefill fits predicted.
RATIO_HISTOGRAMS = ("pd_ttft_prediction_ratio_bucket{", "pd_itl_prediction_ratio_bucket{")


def ratio_medians(delta: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """Median measured/predicted ratio per histogram and route, from one point's bucket
    deltas (Prometheus' ``histogram_quantile``: linear within the bucket holding the median;
    None with no observation, the last finite bound when it lies beyond)."""
    buckets: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for key, count in delta.items():
        if key.count("|") != 2:
            continue
        name, route, le = key.split("|")
        short = name.removeprefix("pd_").removesuffix("_prediction_ratio")
        buckets.setdefault((short, route), []).append((float(le), count))
    out: dict[str, dict[str, float | None]] = {}
    for (name, route), cum in buckets.items():
        cum.sort()
        total = cum[-1][1] if cum else 0.0
        median: float | None = None
        if total > 0:
            lo_bound, lo_count = 0.0, 0.0
            for bound, count in cum:
                if count >= total / 2:
                    if bound == float("inf"):
                        median = lo_bound
                    else:
                        share = (total / 2 - lo_count) / max(count - lo_count, 1e-9)
                        median = round(lo_bound + (bound - lo_bound) * share, 3)
                    break
                lo_bound, lo_count = bound, count
        out.setdefault(name, {})[route] = median
    return out


def _post(url: str, body: dict[str, Any] | None, headers: dict[str, str]) -> None:
    req = urllib.request.Request(url, method="POST", data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
    except urllib.error.HTTPError:
        pass  # a reset refused while a block is still held: tried again below


def cold_caches(proxy: str, model: str, engine_headers: dict[str, str],
                timeout_s: float = 120.0) -> None:
    """Empty both engines' prefix caches, and the proxy's index of them, so each arm starts
    cold. Every arm gets the same prompts: without this the first arm at a point computes
    them and the others find them cached (the arms' order would decide their TTFTs). vLLM's
    dev endpoint does the reset; an idle engine publishes its KV events only with its next
    step, so a one-token request (shorter than a block: it caches nothing) flushes them."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(proxy + "/pd/costs", timeout=30) as r:
            engines = json.loads(r.read())["engines"].values()
        if all(e["cached_blocks"] == 0 for e in engines):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"prefix caches not emptied in {timeout_s:.0f}s")
        for e in engines:
            _post(e["url"] + "/reset_prefix_cache", None, engine_headers)
            _post(e["url"] + "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1},
                  engine_headers)
        time.sleep(0.5)


def wait_idle(proxy: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(proxy + "/pd/costs", timeout=30) as r:
            engines = json.loads(r.read())["engines"].values()
        if all(e["engine_requests"] == 0 and e["inflight"] == 0 for e in engines):
            return
        time.sleep(0.5)


def run_model(args: argparse.Namespace, model: str, workloads: list[str],
              extra: dict[str, str], data_dir: Path) -> dict[str, Any]:
    from launch.models import ensure_model

    tokenizer = str(ensure_model(model))
    served = SERVED[model]
    n_default, fractions_default = MODEL_SCALE[model]
    n = args.requests or n_default
    fractions = (tuple(float(x) for x in args.rate_fractions.split(","))
                 if args.rate_fractions else fractions_default)
    import asyncio

    asyncio.run(wait_ports_free([args.port, args.engine_base_port, args.engine_base_port + 1]))
    log(f"{model}: starting pdserve dev --layout pool ...")
    stack = start_dev(
        log_dir=ROOT / ".pdserve" / f"bench-goodput-{model}", port=args.port,
        engine_base_port=args.engine_base_port,
        side_channel_base_port=args.side_channel_base_port,
        kv_events_base_port=args.kv_events_base_port, model=model, policy="auto",
        extra=["--layout", "pool", "--kv-cache-gib", "2", "--engine-dev-endpoints"])
    proxy = stack.proxy_url
    out: dict[str, Any] = {"startup_s": stack.startup_s, "workloads": {}}
    try:
        for workload in workloads:
            mix = WORKLOADS[workload]
            arms = arm_routings(workload, extra)
            if args.arms:
                wanted = set(args.arms.split(",")) | {"aggregated"}  # the baseline, always
                arms = {a: r for a, r in arms.items() if a in wanted}
            rng = random.Random(args.seed)
            # Unloaded figures: one request at a time on an idle aggregated deployment.
            set_routing(proxy, arms["aggregated"])
            wait_idle(proxy)
            cold_caches(proxy, served, stack.engine_headers)
            wait_idle(proxy)
            single = bench(proxy, served, tokenizer, workload, 4 * len(mix), math.inf,
                           args.seed + 1, data_dir, concurrency=1)
            by_class: dict[str, list[float]] = {}
            gaps = []
            for ttft, itls, inp in zip(single["ttfts"], single["itls"], single["input_lens"]):
                by_class.setdefault(str(request_class(inp, mix)), []).append(ttft)
                if itls:
                    gaps.append(p99(itls))
            unloaded = {"ttft_s": {c: statistics.median(v) for c, v in by_class.items()},
                        "itl_s": statistics.median(gaps)}
            targets = {"ttft_s": {c: args.ttft_factor * v
                                  for c, v in unloaded["ttft_s"].items()},
                       "itl_s": args.itl_factor * unloaded["itl_s"]}
            # Capacity: a burst on aggregated.
            wait_idle(proxy)
            cold_caches(proxy, served, stack.engine_headers)
            wait_idle(proxy)
            burst = bench(proxy, served, tokenizer, workload, n, math.inf, args.seed + 2,
                          data_dir)
            capacity = burst["completed"] / burst["duration"]
            rates = [round(f * capacity, 4) for f in fractions]
            # The targets the SLO-aware arms are given (the load generator sends one body for
            # all): both for a workload of one prompt length; for a mix, the ITL target only
            # (its TTFT targets differ per prompt length).
            slo = {"itl_ms": 1e3 * targets["itl_s"]}
            if len(mix) == 1:
                slo["ttft_ms"] = 1e3 * next(iter(targets["ttft_s"].values()))
            own_ttft = {k: 1e3 * v for k, v in targets["ttft_s"].items()}
            log(f"{model}/{workload}: unloaded TTFT {unloaded['ttft_s']} s, p99 gap "
                f"{unloaded['itl_s'] * 1e3:.1f} ms -> targets {targets}; capacity "
                f"{capacity:.3f} req/s -> rates {rates}")
            points: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
            for repeat in range(args.repeats):
                for i, rate in enumerate(rates):
                    order = list(arms)
                    rng.shuffle(order)
                    for arm in order:
                        set_routing(proxy, arms[arm])
                        wait_idle(proxy)
                        cold_caches(proxy, served, stack.engine_headers)
                        wait_idle(proxy)
                        before = proxy_metrics(proxy)
                        seed = args.seed + 100 * repeat + i  # same prompts, cold caches
                        prefix = f"{arm}-r{repeat}-{i}-"
                        result = bench(proxy, served, tokenizer, workload, n, rate, seed,
                                       data_dir, slo=slo if arm in WITH_TARGETS else None,
                                       request_id_prefix=prefix,
                                       ttft_ms=own_ttft if arm in OWN_TTFT_TARGET else None)
                        after = proxy_metrics(proxy)
                        score = attainment(result, targets, mix)
                        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                        routes = {k: v for k, v in delta.items() if "/" not in k
                                  and "|" not in k}
                        reasons = {k: v for k, v in delta.items() if "/" in k and v}
                        points[arm].append({"repeat": repeat, "rate": rate, **score,
                                            "routes": routes, "reasons": reasons,
                                            "prediction_ratio_median": ratio_medians(delta),
                                            "ttfts": result["ttfts"], "itls": result["itls"],
                                            "input_lens": result["input_lens"],
                                            "decisions": decisions(proxy, prefix, n),
                                            "duration_s": result["duration"]})
                        log(f"{model}/{workload} r{repeat} {rate:.3f} req/s {arm:13s}: "
                            f"{score['good']}/{score['requests']} good, {score['failed']} "
                            f"failed, routes {routes}")
            summary = {}
            for arm, pts in points.items():
                per_repeat = [highest_good_rate([(p["rate"], p["attainment"]) for p in pts
                                                 if p["repeat"] == r])
                              for r in range(args.repeats)]
                summary[arm] = {"highest_good_rate": per_repeat,
                                "mean_attainment": [mean_attainment(pts, r)
                                                    for r in range(args.repeats)],
                                "failed": sum(p["failed"] for p in pts)}
            out["workloads"][workload] = {"unloaded": unloaded, "targets": targets,
                                          "slo_sent": slo, "ttft_ms_own": own_ttft,
                                          "capacity_req_s": capacity, "rates": rates,
                                          "arms": {a: arms[a] for a in arms},
                                          "points": points, "summary": summary}
            report(model, workload, summary)
        return out
    finally:
        stack.stop()


def mean_attainment(points: list[dict[str, Any]], repeat: int) -> float:
    """One repeat's attainment averaged over the swept rates: the area under its curve, less
    at the mercy of one noisy point than the 90 % crossing."""
    values = [p["attainment"] for p in points if p["repeat"] == repeat]
    return round(sum(values) / len(values), 3) if values else 0.0


def report(model: str, workload: str, summary: dict[str, Any]) -> None:
    base = summary["aggregated"]["highest_good_rate"]
    base_mean = _mean(base)
    for arm, s in summary.items():
        rates = s["highest_good_rate"]
        mean = _mean(rates)
        spread = (max(r or 0 for r in rates) - min(r or 0 for r in rates)) if rates else 0
        ratio = (mean / base_mean) if mean is not None and base_mean else None
        att = "/".join(f"{a:.2f}" for a in s.get("mean_attainment", []))
        log(f"  {model}/{workload} {arm:13s}: highest rate with >= 90 % good "
            f"{_fmt(rates)} req/s (spread {spread:.3f}); x{ratio:.2f} of aggregated; mean "
            f"attainment {att}" if ratio is not None else
            f"  {model}/{workload} {arm:13s}: highest rate with >= 90 % good {_fmt(rates)}; "
            f"mean attainment {att}")


def _mean(xs: list[float | None]) -> float | None:
    vals = [x if x is not None else 0.0 for x in xs]
    return sum(vals) / len(vals) if vals else None


def _fmt(xs: list[float | None]) -> str:
    return "/".join("none" if x is None else f"{x:.3f}" for x in xs)


def plot(results: dict[str, Any]):
    def draw(fig) -> None:
        cells = [(m, w) for m, r in results["models"].items() for w in r["workloads"]]
        cols = min(3, len(cells)) or 1
        rows = math.ceil(len(cells) / cols) or 1
        for k, (model, workload) in enumerate(cells):
            ax = fig.add_subplot(rows, cols, k + 1)
            wl = results["models"][model]["workloads"][workload]
            for arm, pts in wl["points"].items():
                by_rate: dict[float, list[float]] = {}
                for p in pts:
                    by_rate.setdefault(p["rate"], []).append(p["attainment"])
                xs = sorted(by_rate)
                ax.errorbar(xs, [statistics.mean(by_rate[x]) for x in xs],
                            yerr=[(max(by_rate[x]) - min(by_rate[x])) / 2 for x in xs],
                            marker="o", capsize=3, label=arm)
            ax.axhline(GOOD_SHARE, color="grey", linestyle=":")
            ax.set_ylim(-0.05, 1.05)
            ax.set_title(f"{model} / {workload}")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("SLO attainment")
            ax.legend(fontsize=8)
    return draw


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
    extra = dict(x.split("=", 1) for x in args.extra_arm)
    results: dict[str, Any] = {"config": vars(args), "models": {}}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-goodput-") as tmp:
        for model in args.models.split(","):
            results["models"][model] = run_model(args, model, args.workloads.split(","),
                                                 extra, Path(tmp))
    results["run_s"] = time.monotonic() - t0
    json_path, png_path = save_results(args.name, results, plot(results))
    log(f"done in {results['run_s'] / 60:.1f} min; wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

