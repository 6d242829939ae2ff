"""Where a disaggregated request's time to first token goes, on the real tiny stack.

For fresh prompts of ``--prompt-tokens`` tokens (random words: no prefix-cache hits), each round
sends, in a shuffled order, four requests of the same shape, each with its own fresh prompt:

- ``pd1``  — P/D done by this client: prefill request straight to the prefill engine (timed),
  then the decode request (``max_tokens=1``, streamed) straight to the decode engine;
- ``pd16`` — the same with ``max_tokens=16`` (gives one decode step: the inter-token gaps);
- ``proxy`` — the request through the proxy (streamed, ``max_tokens=16``), route disaggregated;
- ``local`` — the request straight to the decode engine with no KV params (it computes the prompt).

Around every P/D decode request the decode engine's Prometheus series are read: NIXL transfer
time and bytes (``vllm:nixl_xfer_time_seconds``, ``vllm:nixl_bytes_transferred``) and the engine's
own request timings (queue = waiting for the KV, prefill = the one scheduled step, TTFT as its
front end saw it). The hand-over (decode request sent -> first content event) is then split into:
HTTP in/out, front end <-> engine core, waiting for the KV beyond the NIXL transfer itself, the
transfer, and the one step that computes the first token.

First requests: before the steady-state rounds the benchmark starts the two engines alone (no
proxy, nothing warms them) and times the first direct P/D pairs; then it starts ``pdserve dev``
(which warms up before ``/health`` turns 200) and times the first requests through the proxy
right after ``/health`` turned 200 — what a user sees.

Run: ``python -m benchmarks.ttft_breakdown`` (``--help`` for counts and ports).
Writes ``benchmarks/results/ttft_breakdown.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import (
    TINY_SERVED_NAME,
    BareEngines,
    Prompts,
    StreamTiming,
    exit_on_sigterm,
    fmt_ms,
    idle_thread_cpu,
    log,
    machine_info,
    metric_delta,
    save_results,
    scrape,
    summarize,
    timed_post,
    timed_stream,
    wait_ports_free,
)
from harness.stack import ENGINE_KEY_ENV, start_dev
from transport import kv_params

CHAT = "/v1/chat/completions"
#: Decode-engine series read around every P/D decode request (sum, count deltas).
ENGINE_SERIES = {
    "xfer": "vllm:nixl_xfer_time_seconds",
    "bytes": "vllm:nixl_bytes_transferred",
    "post": "vllm:nixl_post_time_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "step": "vllm:request_prefill_time_seconds",
    "engine_ttft": "vllm:time_to_first_token_seconds",
    # first token -> last token, engine side: decode steps as the engine ran them, whatever
    # batching the stream does on its way to the client
    "decode": "vllm:request_decode_time_seconds",
}

#: A request slower than this is recorded as failed (a stuck hand-over waits out the lease: 30 s).
REQUEST_TIMEOUT_S = 90.0
# Targets from the issue.
TARGET_HANDOVER_BEYOND_MS = 30.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ttft_breakdown", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20, help="measured rounds (each: pd1, pd16, proxy, "
                   "local; fresh prompts)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured rounds first")
    p.add_argument("--prompt-tokens", type=int, default=1600)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--first-requests", type=int, default=3,
                   help="requests timed one after another on brand-new engines (0: skip the "
                        "fresh-engine phases)")
    p.add_argument("--port", type=int, default=28000, help="proxy port")
    p.add_argument("--engine-base-port", type=int, default=28100)
    p.add_argument("--side-channel-base-port", type=int, default=25600)
    p.add_argument("--kv-events-base-port", type=int, default=25700)
    p.add_argument("--attach", action="store_true",
                   help="use a pdserve dev already serving on these ports (no start/stop, no "
                        "fresh-engine phases)")
    p.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: a temp dir)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--mode", choices=("full", "nixl-fix-ab"), default="full",
                   help="full: fresh engines alone (first requests), then pdserve dev (first "
                        "requests through the proxy, steady state). nixl-fix-ab: engines alone "
                        "once per --arms entry, steady state on each, p50s side by side")
    p.add_argument("--arms", default="vllm,both",
                   help="nixl-fix-ab arms, in order: vllm (vLLM's NixlConnector as is), delay "
                        "(transport.nixl_cpu: NIXL progress thread polls with a timeout), "
                        "affinity (transport.nixl_cpu: undo vLLM's re-pinning of the compute "
                        "thread), both, launched (the config pdserve generates)")
    p.add_argument("--nixl-progress-delay-us", type=int, default=1000,
                   help="progress-thread poll delay of the delay/both arms")
    p.add_argument("--name", default="ttft_breakdown", help="results file name")
    p.add_argument("--reanalyse", type=Path, default=None, metavar="JSON",
                   help="recompute the report, JSON summary and plot of a saved run")
    return p.parse_args(argv)


class Client:
    """The benchmark's own P/D client, plus the proxy and local requests, all timed."""

    def __init__(self, session: aiohttp.ClientSession, prompts: Prompts, args: argparse.Namespace,
                 proxy_url: str, prefill_url: str, decode_url: str):
        self.session = session
        self.prompts = prompts
        self.args = args
        self.proxy_url = proxy_url
        self.prefill_url = prefill_url
        self.decode_url = decode_url

    def body(self, max_tokens: int) -> dict[str, Any]:
        return {
            "model": TINY_SERVED_NAME,
            "messages": self.prompts.messages(self.args.prompt_tokens),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # always max_tokens tokens: comparable step counts
            "stream": True,
        }

    async def engine_metrics(self) -> dict[str, float]:
        return await scrape(self.session, self.decode_url)

    async def engine_deltas(self, before: dict[str, float], expect_xfer: bool) -> dict[str, Any]:
        """Decode-engine series deltas for one finished request (waits for them to land)."""
        deadline = time.perf_counter() + 2.0
        while True:
            after = await self.engine_metrics()
            done = (metric_delta(before, after, ENGINE_SERIES["queue"] + "_count") or 0) >= 1
            xfer_done = (metric_delta(before, after, ENGINE_SERIES["xfer"] + "_count") or 0) >= 1
            if (done and (xfer_done or not expect_xfer)) or time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.02)
        out: dict[str, Any] = {}
        for key, series in ENGINE_SERIES.items():
            out[f"{key}_sum"] = metric_delta(before, after, series + "_sum")
            out[f"{key}_count"] = metric_delta(before, after, series + "_count")
        return out

    async def pd(self, max_tokens: int) -> dict[str, Any]:
        """Prefill on the prefill engine, then the streamed decode on the decode engine."""
        body = self.body(max_tokens)
        pbody = dict(body, max_tokens=1, stream=False, return_token_ids=True)
        pbody[kv_params.BODY_KEY] = kv_params.prefill_request_params()
        before = await self.engine_metrics()
        t0 = time.perf_counter()
        reply = await timed_post(self.session, self.prefill_url + CHAT, pbody, REQUEST_TIMEOUT_S)
        if reply.status != 200:
            raise RuntimeError(f"prefill answered {reply.status}: {str(reply.body)[:300]}")
        handoff = kv_params.parse_prefill_reply(reply.body)
        dbody = dict(body)
        dbody[kv_params.BODY_KEY] = kv_params.decode_request_params(handoff)
        t_handoff = time.perf_counter()
        st = await timed_stream(self.session, self.decode_url + CHAT, dbody,
                                timeout_s=REQUEST_TIMEOUT_S)
        _check(st, "decode")
        deltas = await self.engine_deltas(before, expect_xfer=handoff.has_blocks)
        return {
            "prompt_tokens": len(handoff.prompt_token_ids),
            "prefill_cached_tokens": handoff.cached_tokens,
            "prefill_s": reply.elapsed_s,
            "client_handoff_s": t_handoff - t0 - reply.elapsed_s,
            "handover_s": st.ttft_s,
            "handover_headers_s": st.headers_s,
            "handover_first_event_s": (st.t_first_event - st.t_sent) if st.t_first_event else None,
            "ttft_s": st.t_first_content - t0 if st.t_first_content else None,
            "gaps_s": st.gaps_s,
            "content_events": len(st.content_times),
            **deltas,
        }

    async def proxy(self, max_tokens: int) -> dict[str, Any]:
        st = await timed_stream(self.session, self.proxy_url + CHAT, self.body(max_tokens),
                                timeout_s=REQUEST_TIMEOUT_S)
        _check(st, "proxy")
        return {"ttft_s": st.ttft_s, "headers_s": st.headers_s, "gaps_s": st.gaps_s,
                "route": st.headers.get("x-pd-route"), "content_events": len(st.content_times)}

    async def local(self, max_tokens: int) -> dict[str, Any]:
        before = await self.engine_metrics()
        st = await timed_stream(self.session, self.decode_url + CHAT, self.body(max_tokens),
                                timeout_s=REQUEST_TIMEOUT_S)
        _check(st, "local")
        deltas = await self.engine_deltas(before, expect_xfer=False)
        return {"ttft_s": st.ttft_s, "headers_s": st.headers_s, "gaps_s": st.gaps_s,
                "content_events": len(st.content_times), **deltas}


def _check(st: StreamTiming, what: str) -> None:
    if st.status != 200 or st.error or st.t_first_content is None:
        raise RuntimeError(f"{what} request failed: status {st.status}: {st.error}")


# --- phases -----------------------------------------------------------------------------------


async def steady_state(client: Client, args: argparse.Namespace, kinds: list[str]
                       ) -> dict[str, list[dict]]:
    """``warmup`` + ``n`` rounds; each round sends every kind once, in a shuffled order."""
    make = {
        "pd1": lambda: client.pd(1),
        "pd16": lambda: client.pd(args.decode_tokens),
        "proxy": lambda: client.proxy(args.decode_tokens),
        "local": lambda: client.local(args.decode_tokens),
    }
    rng = random.Random(args.seed)
    samples: dict[str, list[dict]] = {k: [] for k in kinds}
    failures: list[dict[str, Any]] = []
    samples["failures"] = failures
    for r in range(args.warmup + args.n):
        order = list(kinds)
        rng.shuffle(order)
        measured = r >= args.warmup
        for kind in order:
            try:
                s = await make[kind]()
            except (RuntimeError, aiohttp.ClientError, kv_params.HandoffError,
                    TimeoutError) as exc:  # a failed request is reported, not fatal
                log(f"  {kind} request failed: {exc}"[:300])
                failures.append({"round": r - args.warmup, "kind": kind, "error": str(exc)[:500]})
                continue
            if measured:
                s["round"] = r - args.warmup
                samples[kind].append(s)
        if not measured:
            log(f"  warm-up round {r + 1}/{args.warmup}")
            continue
        if not samples["pd1"]:
            continue
        last = samples["pd1"][-1]
        line = (f"  round {r - args.warmup + 1}/{args.n}: prefill "
                f"{last['prefill_s'] * 1e3:.0f} ms, hand-over {last['handover_s'] * 1e3:.0f} ms "
                f"(NIXL {_ms(last, 'xfer')} ms)")
        for kind in ("proxy", "local"):
            if samples.get(kind):
                line += f", {kind} TTFT {samples[kind][-1]['ttft_s'] * 1e3:.0f} ms"
        log(line)
    return samples


def _ms(sample: dict[str, Any], key: str) -> str:
    v = sample.get(f"{key}_sum")
    return "n/a" if v is None else f"{v * 1e3:.1f}"


#: The --mode nixl-fix-ab arms: name -> (progress-thread delay in us or None, restore affinity),
#: applied through transport.nixl_cpu; "vllm" is vLLM's own NixlConnector (neither fix), "launched"
#: leaves the config exactly as pdserve generates it (on CPU today: both fixes).
FIX_ARMS: dict[str, tuple[int | None, bool] | None] = {
    "launched": None,
    "vllm": (None, False),
    "delay": (1000, False),
    "affinity": (None, True),
    "both": (1000, True),
}


def fix_config_edit(delay_us: int | None, restore_affinity: bool):
    """``--kv-transfer-config`` edit of the NIXL child: vLLM's connector, or transport.nixl_cpu
    with only the requested fixes."""
    from transport import nixl_cpu

    def edit(role: str, config: dict[str, Any]) -> None:
        for child in config["kv_connector_extra_config"]["connectors"]:
            if child["kv_connector"] != "NixlConnector":
                continue
            extra = child["kv_connector_extra_config"]
            child.pop("kv_connector_module_path", None)
            extra.pop(nixl_cpu.DELAY_KEY, None)
            extra.pop(nixl_cpu.AFFINITY_KEY, None)
            if delay_us or restore_affinity:
                child["kv_connector_module_path"] = nixl_cpu.MODULE_PATH
            if delay_us:
                extra[nixl_cpu.DELAY_KEY] = delay_us
            if restore_affinity:
                extra[nixl_cpu.AFFINITY_KEY] = True
    return edit


async def bare_phase(args: argparse.Namespace, prompts: Prompts, log_dir: Path, label: str,
                     fix: tuple[int | None, bool] | None, steady: bool) -> dict[str, Any]:
    """Engines alone (no proxy, nothing warms them): idle CPU, the first direct P/D requests,
    and (``steady``) the steady-state rounds without the proxy. ``fix`` None = the connector
    config exactly as pdserve generates it."""
    log(f"[{label}] starting prefill + decode engines alone (no proxy) ...")
    engines = BareEngines(
        log_dir=log_dir / label.replace(" ", "_"), engine_base_port=args.engine_base_port,
        side_channel_base_port=args.side_channel_base_port,
        kv_events_base_port=args.kv_events_base_port,
        kv_config_edit=fix_config_edit(*fix) if fix is not None else None,
    )
    out: dict[str, Any] = {"label": label, "connector": engines.prefill_kv_config}
    try:
        out["startup_s"] = engines.t_ready - engines.t_launch
        log(f"[{label}] engines ready after {out['startup_s']:.0f}s")
        out["idle_threads_fresh"] = idle_thread_cpu(engines.pgids)
        _log_idle(f"{label}, before any request", out["idle_threads_fresh"])
        async with aiohttp.ClientSession() as session:
            client = Client(session, prompts, args, "", engines.prefill_url, engines.decode_url)
            first = []
            for i in range(args.first_requests):
                s = await client.pd(1)
                first.append(s)
                log(f"[{label}] direct P/D #{i + 1} on fresh engines: prefill "
                    f"{s['prefill_s'] * 1e3:.0f} ms, hand-over {s['handover_s'] * 1e3:.0f} ms, "
                    f"NIXL {_ms(s, 'xfer')} ms")
            out["first_samples"] = first
            out["idle_threads_connected"] = idle_thread_cpu(engines.pgids)
            _log_idle(f"{label}, after P/D", out["idle_threads_connected"])
            if steady:
                log(f"[{label}] steady state: {args.warmup} warm-up + {args.n} rounds")
                out["samples"] = await steady_state(client, args, ["pd1", "pd16", "local"])
        return out
    finally:
        t0 = time.perf_counter()
        engines.stop()
        log(f"[{label}] engines stopped in {time.perf_counter() - t0:.0f}s")
        out["engine_log_scan"] = scan_engine_logs(log_dir / label.replace(" ", "_"))


LEASE_PATTERNS = {
    "lease_expired_unread": "Releasing expired KV blocks",
    "read_after_expiry": "Potentially invalid KV blocks",
    "failed_transfers": "failure_type=transfer",
}


def scan_engine_logs(log_dir: Path) -> dict[str, Any]:
    """Count the NIXL lease/transfer trouble the engines logged (read-after-expiry = decode may
    have read blocks the prefill engine had already freed)."""
    counts = {k: 0 for k in LEASE_PATTERNS}
    examples: list[str] = []
    for path in sorted(log_dir.rglob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            for key, pattern in LEASE_PATTERNS.items():
                if pattern in line:
                    counts[key] += 1
                    if len(examples) < 6:
                        examples.append(line[:240])
    return {**counts, "examples": examples}


def _log_idle(label: str, rows: list[dict[str, Any]]) -> None:
    busy = [f"{r['name']}/{r['tid']} {r['cpu_fraction'] * 100:.0f}% (cpus {r['cpus_allowed']})"
            for r in rows[:3]]
    log(f"[{label}] idle engines, busiest threads: {', '.join(busy) or 'none'}")


async def dev_phase(args: argparse.Namespace, prompts: Prompts, log_dir: Path
                    ) -> dict[str, Any]:
    """``pdserve dev`` as users start it: first requests right after /health=200, then rounds."""
    urls = (f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.engine_base_port}",
            f"http://127.0.0.1:{args.engine_base_port + 1}")
    out: dict[str, Any] = {}
    stack = None
    try:
        if not args.attach:
            log("[dev] starting pdserve dev (engines, then the proxy's warm-up and probes) ...")
            stack = start_dev(log_dir=log_dir / "dev", port=args.port, policy="disaggregate",
                                   engine_base_port=args.engine_base_port,
                                   side_channel_base_port=args.side_channel_base_port,
                                   kv_events_base_port=args.kv_events_base_port)
            out["startup_s"] = stack.startup_s
            log(f"[dev] /health=200 after {stack.startup_s:.0f}s")
        # Attached to a running stack: its engine key from the environment it was started with.
        key = stack.engine_key if stack is not None else os.environ.get(ENGINE_KEY_ENV, "")
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            headers={"Authorization": f"Bearer {key}"} if key else None,
        ) as session:
            client = Client(session, prompts, args, *urls)
            if stack is not None and args.first_requests > 0:
                first = []
                for i in range(args.first_requests):
                    t_send = time.perf_counter()
                    s = await client.proxy(args.decode_tokens)
                    s["sent_after_health_s"] = t_send - stack.t_health
                    first.append(s)
                    log(f"[dev] proxy request #{i + 1} right after /health=200: TTFT "
                        f"{s['ttft_s'] * 1e3:.0f} ms (route {s['route']})")
                out["first_samples"] = first
                out["idle_threads"] = idle_thread_cpu(stack.pgids)
                _log_idle("dev", out["idle_threads"])
            log(f"[dev] steady state: {args.warmup} warm-up + {args.n} rounds")
            out["samples"] = await steady_state(client, args, ["pd1", "pd16", "proxy", "local"])
        return out
    finally:
        if stack is not None:
            log("[dev] stopping pdserve dev")
            stack.stop()
            out["engine_log_scan"] = scan_engine_logs(log_dir / "dev")


# --- analysis ---------------------------------------------------------------------------------


def per_request_breakdown(s: dict[str, Any]) -> dict[str, float | None]:
    """Split one P/D sample's hand-over (seconds) into where it went."""
    one = lambda key: s[f"{key}_sum"] if s.get(f"{key}_count") == 1 else None  # noqa: E731
    handover = s["handover_s"]
    xfer, queue, step, ettft = one("xfer"), one("queue"), one("step"), one("engine_ttft")
    out: dict[str, float | None] = {
        "handover": handover,
        "transfer": xfer,
        "engine_queue": queue,
        "engine_first_step": step,
    }
    if ettft is not None:
        # client -> API server (HTTP, JSON, validation) and the first SSE event back
        out["http_in_out"] = handover - ettft
        if queue is not None and step is not None:
            # API server <-> engine core: request processing, IPC, output processing
            out["frontend_to_core"] = ettft - queue - step
    if queue is not None and xfer is not None:
        # queued on the decode engine but not moving bytes: scheduling the pull, posting it,
        # noticing completion, the step that promotes the request
        out["kv_wait_beyond_transfer"] = queue - xfer
    return out


PART_KEYS = ["http_in_out", "frontend_to_core", "kv_wait_beyond_transfer", "transfer",
             "engine_first_step"]


def analyse(samples: dict[str, list[dict]]) -> dict[str, Any]:
    pd1, pd16 = samples["pd1"], samples["pd16"]
    steps = [x for x in (mean_step(s) for s in pd16) if x is not None]
    itl_p50 = summarize(steps).get("p50")
    pd = pd1 + pd16
    summary: dict[str, Any] = {
        "failed_requests": len(samples.get("failures", [])),
        "prompt_tokens": summarize([s["prompt_tokens"] for s in pd1]),
        "prefill_ms": summarize([s["prefill_s"] for s in pd], 1e3),
        "transfer_ms": summarize([s["xfer_sum"] for s in pd if s.get("xfer_count") == 1], 1e3),
        "transfer_bytes": summarize([s["bytes_sum"] for s in pd if s.get("bytes_count") == 1]),
        "transfer_post_ms": summarize([s["post_sum"] for s in pd if s.get("post_count") == 1],
                                      1e3),
        "handover_max1_ms": summarize([s["handover_s"] for s in pd1], 1e3),
        "handover_max16_ms": summarize([s["handover_s"] for s in pd16], 1e3),
        "itl_ms": summarize(steps, 1e3),
        "itl_client_ms": summarize([client_step(s) for s in pd16], 1e3),
        "direct_pd_ttft_max16_ms": summarize([s["ttft_s"] for s in pd16], 1e3),
        "local_ttft_ms": summarize([s["ttft_s"] for s in samples["local"]], 1e3),
        "local_itl_ms": summarize([mean_step(s) for s in samples["local"]], 1e3),
    }
    if "proxy" in samples:
        summary["proxy_ttft_ms"] = summarize([s["ttft_s"] for s in samples["proxy"]], 1e3)
        summary["proxy_itl_ms"] = summarize([mean_step(s) for s in samples["proxy"]], 1e3)
        summary["proxy_routes"] = sorted({str(s["route"]) for s in samples["proxy"]})
        summary["proxy_minus_direct_pd_ttft_ms"] = _diff(summary["proxy_ttft_ms"],
                                                         summary["direct_pd_ttft_max16_ms"])
    # Hand-over beyond each request's own transfer and one decode step (the run's median gap).
    for kind, group in (("max1", pd1), ("max16", pd16)):
        beyond = [s["handover_s"] - s["xfer_sum"] - itl_p50 for s in group
                  if s.get("xfer_count") == 1 and itl_p50 is not None]
        summary[f"handover_beyond_transfer_and_step_{kind}_ms"] = summarize(beyond, 1e3)
    parts = [per_request_breakdown(s) for s in pd1]
    summary["handover_parts_max1_ms"] = {k: summarize([p.get(k) for p in parts], 1e3)
                                         for k in ["engine_queue", *PART_KEYS]}
    return summary


def mean_step(sample: dict[str, Any]) -> float | None:
    """One decode step of a stream, from the engine's own decode time over the steps after the
    first token (the client may get several tokens in one read: its gaps are then 0); falls back
    to the client-side first-to-last content event spread."""
    steps = len(sample.get("gaps_s") or [])
    if sample.get("decode_count") == 1 and sample.get("decode_sum") and steps:
        return sample["decode_sum"] / steps
    gaps = sample.get("gaps_s") or []
    return sum(gaps) / len(gaps) if gaps else None


def client_step(sample: dict[str, Any]) -> float | None:
    gaps = sample.get("gaps_s") or []
    return sum(gaps) / len(gaps) if gaps else None


def _diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    return {k: (a[k] - b[k]) if a.get("n") and b.get("n") else None for k in ("p50", "p90")}


def analyse_first(bare: dict[str, Any] | None, dev: dict[str, Any] | None,
                  summary: dict[str, Any]) -> dict[str, Any]:
    """First requests on brand-new engines against the steady-state p50s."""
    out: dict[str, Any] = {}
    if bare and bare.get("first_samples"):
        first = bare["first_samples"]
        s0 = first[0]
        out["direct_first"] = {
            "prefill_ms": s0["prefill_s"] * 1e3,
            "handover_ms": s0["handover_s"] * 1e3,
            "ttft_ms": s0["ttft_s"] * 1e3,
            "transfer_ms": s0["xfer_sum"] * 1e3 if s0.get("xfer_count") == 1 else None,
            "prefill_penalty_ms": s0["prefill_s"] * 1e3 - summary["prefill_ms"]["p50"],
            "handover_penalty_ms": s0["handover_s"] * 1e3 - summary["handover_max1_ms"]["p50"],
            "ttft_penalty_ms": (s0["prefill_s"] + s0["handover_s"]) * 1e3
            - summary["prefill_ms"]["p50"] - summary["handover_max1_ms"]["p50"],
            "next_handovers_ms": [s["handover_s"] * 1e3 for s in first[1:]],
            "next_prefills_ms": [s["prefill_s"] * 1e3 for s in first[1:]],
        }
    if dev and dev.get("first_samples") and "proxy_ttft_ms" in summary:
        first = dev["first_samples"]
        out["proxy_first"] = {
            "ttft_ms": first[0]["ttft_s"] * 1e3,
            "penalty_ms": first[0]["ttft_s"] * 1e3 - summary["proxy_ttft_ms"]["p50"],
            "next_ttfts_ms": [s["ttft_s"] * 1e3 for s in first[1:]],
            "sent_after_health_ms": first[0].get("sent_after_health_s", 0) * 1e3,
        }
    return out


# --- report -----------------------------------------------------------------------------------


def report_rows(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    rows = [
        ("(a) prefill (direct, max_tokens=1)", summary["prefill_ms"]),
        ("(b) NIXL transfer (decode engine's metric)", summary["transfer_ms"]),
        ("(c) hand-over, decode max_tokens=1", summary["handover_max1_ms"]),
        ("(c) hand-over, decode max_tokens=16", summary["handover_max16_ms"]),
        ("(d) one decode step (ITL, engine, P/D streams)", summary["itl_ms"]),
        ("    ITL as the client saw it (0 = tokens bunched)", summary["itl_client_ms"]),
        ("    direct P/D TTFT (prefill + hand-over)", summary["direct_pd_ttft_max16_ms"]),
    ]
    if "proxy_ttft_ms" in summary:
        rows.append(("(e) TTFT through the proxy (P/D)", summary["proxy_ttft_ms"]))
    rows += [
        ("(e) TTFT local (decode engine alone)", summary["local_ttft_ms"]),
        ("    ITL local (decode engine alone)", summary["local_itl_ms"]),
        ("hand-over - transfer - ITL, max_tokens=1",
         summary["handover_beyond_transfer_and_step_max1_ms"]),
        ("hand-over - transfer - ITL, max_tokens=16",
         summary["handover_beyond_transfer_and_step_max16_ms"]),
    ]
    return rows


def print_summary(title: str, summary: dict[str, Any]) -> None:
    p = lambda *a: print(*a, flush=True)  # noqa: E731
    p(f"\n{title}: {summary['prompt_tokens'].get('p50', 0):.0f}-token prompts, "
      f"n={summary['handover_max1_ms'].get('n')} per kind; ms p50 / p90")
    for label, s in report_rows(summary):
        p(f"  {label:46s} {fmt_ms(s)}")
    b, t = summary["transfer_bytes"], summary["transfer_ms"]
    if b.get("n") and t.get("n"):
        p(f"  KV per request {b['p50'] / 1e6:.2f} MB -> {b['p50'] / t['p50'] / 1e3:.0f} MB/s "
          f"at the p50s")
    if summary["failed_requests"]:
        p(f"  FAILED requests (not in the figures): {summary['failed_requests']}")
    p("  where the hand-over goes (max_tokens=1), ms p50 / p90:")
    for k, s in summary["handover_parts_max1_ms"].items():
        p(f"    {k:44s} {fmt_ms(s)}")
    if "proxy_minus_direct_pd_ttft_ms" in summary:
        ov = summary["proxy_minus_direct_pd_ttft_ms"]
        if ov["p50"] is not None:
            p(f"  proxy TTFT - direct P/D TTFT: p50 {ov['p50']:+.1f} ms, p90 {ov['p90']:+.1f} ms")
    beyond = summary["handover_beyond_transfer_and_step_max1_ms"].get("p50")
    if beyond is not None:
        verdict = "meets" if beyond <= TARGET_HANDOVER_BEYOND_MS else "MISSES"
        p(f"  target: hand-over beyond transfer + one step <= {TARGET_HANDOVER_BEYOND_MS:.0f} ms:"
          f" p50 {beyond:.1f} ms -> {verdict}")


def print_first(first: dict[str, Any]) -> None:
    p = lambda *a: print(*a, flush=True)  # noqa: E731
    if not first:
        return
    p("  (f) first requests on brand-new engines:")
    d = first.get("direct_first")
    if d:
        p(f"    direct, engines alone (no warm-up): prefill {d['prefill_ms']:.0f} ms "
          f"({d['prefill_penalty_ms']:+.0f} vs steady p50), hand-over {d['handover_ms']:.0f} ms "
          f"({d['handover_penalty_ms']:+.0f}), NIXL {d['transfer_ms'] or 0:.0f} ms; next "
          f"hand-overs " + ", ".join(f"{x:.0f}" for x in d["next_handovers_ms"]))
    q = first.get("proxy_first")
    if q:
        # the steady state itself scatters: call it a penalty only beyond 50 ms and 25 %
        verdict = ("PENALTY" if q["penalty_ms"] > max(50.0, 0.25 * (q["ttft_ms"] - q["penalty_ms"]))
                   else "no penalty")
        p(f"    through the proxy right after /health=200: TTFT {q['ttft_ms']:.0f} ms "
          f"({q['penalty_ms']:+.0f} ms vs steady p50: {verdict} within noise); next "
          + ", ".join(f"{x:.0f}" for x in q["next_ttfts_ms"]))


def print_idle(label: str, rows: list[dict[str, Any]] | None) -> None:
    if rows is None:
        return
    busy = ", ".join(f"{r['name']}[{r['tid']}] {r['cpu_fraction'] * 100:.0f}% on cpus "
                     f"{r['cpus_allowed']}" for r in rows[:4]) or "none"
    print(f"  idle engine threads ({label}): {busy}", flush=True)


def print_scan(label: str, scan: dict[str, Any] | None) -> None:
    if not scan:
        return
    print(f"  engine logs ({label}): leases expired unread {scan['lease_expired_unread']}, "
          f"reads after expiry {scan['read_after_expiry']}, failed transfers "
          f"{scan['failed_transfers']}", flush=True)


def plot_full(fig, samples: dict[str, list[dict]], summary: dict[str, Any],
              bare: dict[str, Any] | None, dev: dict[str, Any] | None) -> None:
    ax1 = fig.add_subplot(1, 3, 1)
    _plot_parts(ax1, samples)
    ax2 = fig.add_subplot(1, 3, 2)
    _plot_stages(ax2, samples)
    ax3 = fig.add_subplot(1, 3, 3)
    ttfts = {
        "direct P/D": [s["ttft_s"] * 1e3 for s in samples["pd16"]],
        "proxy P/D": [s["ttft_s"] * 1e3 for s in samples.get("proxy", [])],
        "local": [s["ttft_s"] * 1e3 for s in samples["local"]],
    }
    ax3.boxplot(list(ttfts.values()), tick_labels=list(ttfts.keys()))
    if bare and bare.get("first_samples"):
        ys = [s["ttft_s"] * 1e3 for s in bare["first_samples"]]
        ax3.plot([1.2] * len(ys), ys, "r^", label="first requests, engines alone (direct)")
    if dev and dev.get("first_samples"):
        ys = [s["ttft_s"] * 1e3 for s in dev["first_samples"]]
        ax3.plot([2.2] * len(ys), ys, "mv", label="first requests after /health=200 (proxy)")
    ax3.set_yscale("log")
    ax3.set_ylabel("TTFT, ms (log)")
    ax3.set_title(f"TTFT, {summary['prompt_tokens'].get('p50', 0):.0f}-token prompts")
    ax3.legend(fontsize=7)


def _plot_parts(ax, samples: dict[str, list[dict]], title: str = "") -> None:
    parts = [per_request_breakdown(s) for s in samples["pd1"]]
    x = list(range(len(parts)))
    bottom = [0.0] * len(parts)
    for k in PART_KEYS:
        vals = [max(0.0, (p.get(k) or 0.0)) * 1e3 for p in parts]
        ax.bar(x, vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(x, [p["handover"] * 1e3 for p in parts], "k.", label="hand-over (client)")
    ax.set_title(title or "hand-over per request (decode max_tokens=1)")
    ax.set_xlabel("request")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)


def _plot_stages(ax, samples: dict[str, list[dict]], title: str = "stages, steady state") -> None:
    pd = samples["pd1"] + samples["pd16"]
    series = {
        "prefill": [s["prefill_s"] * 1e3 for s in pd],
        "hand-over\nmax1": [s["handover_s"] * 1e3 for s in samples["pd1"]],
        "hand-over\nmax16": [s["handover_s"] * 1e3 for s in samples["pd16"]],
        "NIXL\nxfer": [s["xfer_sum"] * 1e3 for s in pd if s.get("xfer_count") == 1],
        "ITL": [mean_step(s) * 1e3 for s in samples["pd16"] if mean_step(s) is not None],
    }
    ax.boxplot([v or [0] for v in series.values()], tick_labels=list(series.keys()))
    ax.set_yscale("log")
    ax.set_ylabel("ms (log)")
    ax.set_title(title)


def plot_ab(fig, arms: list[dict[str, Any]]) -> None:
    shown = [arms[0]] + ([a for a in arms[1:] if a["label"] == "both"] or arms[1:2])
    for i, arm in enumerate(shown):
        _plot_parts(fig.add_subplot(2, 2, 1 + i), arm["samples"],
                    f"hand-over parts: {arm['label']}")
    ax = fig.add_subplot(2, 2, 3)
    keys = ["prefill_ms", "transfer_ms", "handover_max1_ms", "itl_ms", "local_ttft_ms"]
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        vals = [arm["summary"][k].get("p50") or 0 for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], vals, width, label=arm["label"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))],
                  [k.replace("_ms", "") for k in keys], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("p50 ms (log)")
    ax.legend(fontsize=7)
    ax.set_title("p50 per stage, side by side")
    ax = fig.add_subplot(2, 2, 4)
    for arm in arms:
        rows = arm.get("idle_threads_fresh") or []
        ax.bar([f"{arm['label']}\n#{i + 1}" for i in range(len(rows[:2]))],
               [r["cpu_fraction"] * 100 for r in rows[:2]])
    ax.set_ylabel("% of a core")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title("two busiest engine threads, fresh engines, no request sent")


# --- main -------------------------------------------------------------------------------------


def _ports(args: argparse.Namespace) -> list[int]:
    return [args.port, args.engine_base_port, args.engine_base_port + 1,
            args.side_channel_base_port, args.side_channel_base_port + 1,
            args.kv_events_base_port, args.kv_events_base_port + 1]


def _args_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


async def run_full(args: argparse.Namespace, prompts: Prompts, log_dir: Path) -> int:
    machine = machine_info()
    bare = None
    if not args.attach:  # a stack stopped just before leaves its ports in TIME_WAIT a while
        await wait_ports_free(_ports(args))
    if args.first_requests > 0 and not args.attach:
        bare = await bare_phase(args, prompts, log_dir, "engines alone", FIX_ARMS["launched"],
                                steady=False)
        waited = await wait_ports_free(_ports(args))
        log(f"ports free after {waited:.0f}s")
    dev = await dev_phase(args, prompts, log_dir)
    report_full(_args_json(args), machine, dev, bare, args.name)
    return 0


def report_full(args_json: dict[str, Any], machine: dict[str, Any], dev: dict[str, Any],
                bare: dict[str, Any] | None, name: str) -> None:
    samples = dev["samples"]
    summary = analyse(samples)
    first = analyse_first(bare, dev, summary)
    print_summary("TTFT breakdown, tiny model, pdserve dev", summary)
    print_first(first)
    if bare:
        print_idle("engines alone, before any request", bare.get("idle_threads_fresh"))
        print_idle("engines alone, after the first P/D", bare.get("idle_threads_connected"))
    print_idle("pdserve dev after warm-up", dev.get("idle_threads"))
    if bare:
        print_scan("engines alone", bare.get("engine_log_scan"))
    print_scan("pdserve dev", dev.get("engine_log_scan"))
    payload = {
        "mode": "full",
        "args": args_json,
        "machine": machine,
        "summary": summary,
        "first_requests": first,
        "targets": {"handover_beyond_transfer_and_step_ms": TARGET_HANDOVER_BEYOND_MS,
                    "first_request_penalty_ms": 0},
        "samples": samples,
        "bare_engines": bare,
        "dev": {k: v for k, v in dev.items() if k != "samples"},
    }
    json_path, png_path = save_results(
        name, payload, lambda fig: plot_full(fig, samples, summary, bare, dev))
    log(f"wrote {json_path} and {png_path}")


async def run_fix_ab(args: argparse.Namespace, prompts: Prompts, log_dir: Path) -> int:
    """Engines alone, once per arm (vLLM's NIXL connector, transport.nixl_cpu's fixes one by one
    or together), steady state on each; p50 ratios side by side."""
    machine = machine_info()
    names = [a.strip() for a in args.arms.split(",") if a.strip()]
    arms = []
    for name in names:
        fix = FIX_ARMS[name]
        if fix is not None and fix[0]:
            fix = (args.nixl_progress_delay_us, fix[1])
        await wait_ports_free(_ports(args))
        arms.append(await bare_phase(args, prompts, log_dir, name, fix, steady=True))
    report_fix_ab(_args_json(args), machine, arms, args.name)
    return 0


def report_fix_ab(args_json: dict[str, Any], machine: dict[str, Any], arms: list[dict[str, Any]],
                  name: str) -> None:
    for arm in arms:
        arm["summary"] = analyse(arm["samples"])
        print_summary(f"engines alone, arm '{arm['label']}'", arm["summary"])
        print_idle(f"{arm['label']}, after P/D", arm.get("idle_threads_connected"))
        print_scan(arm["label"], arm.get("engine_log_scan"))
    base = arms[0]["summary"]
    ratios: dict[str, dict[str, float | None]] = {}
    keys = ("prefill_ms", "transfer_ms", "handover_max1_ms", "handover_max16_ms", "itl_ms",
            "local_ttft_ms", "local_itl_ms", "direct_pd_ttft_max16_ms",
            "handover_beyond_transfer_and_step_max1_ms")
    print(f"\nside by side, p50 ms (ratio to '{arms[0]['label']}'):", flush=True)
    print("  " + " " * 44 + "".join(f"{a['label']:>18s}" for a in arms), flush=True)
    for key in keys:
        cells = []
        for arm in arms:
            a, b = base[key].get("p50"), arm["summary"][key].get("p50")
            ratios.setdefault(arm["label"], {})[key] = (b / a) if a and b else None
            cells.append("n/a" if b is None else
                         f"{b:.1f} (x{b / a:.2f})" if a else f"{b:.1f}")
        print(f"  {key:44s}" + "".join(f"{c:>18s}" for c in cells), flush=True)
    cells = [f"{(a.get('engine_log_scan') or {}).get('read_after_expiry', 0)}" for a in arms]
    print(f"  {'reads after lease expiry (engine logs)':44s}"
          + "".join(f"{c:>18s}" for c in cells), flush=True)
    cells = [f"{max(s['handover_s'] for s in a['samples']['pd1'] + a['samples']['pd16']) * 1e3:.0f}"
             for a in arms]
    print(f"  {'worst hand-over, ms':44s}" + "".join(f"{c:>18s}" for c in cells), flush=True)
    payload = {
        "mode": "nixl-fix-ab",
        "args": args_json,
        "machine": machine,
        "ratios_p50": ratios,
        "arms": arms,
    }
    json_path, png_path = save_results(name, payload, lambda fig: plot_ab(fig, arms))
    log(f"wrote {json_path} and {png_path}")


def reanalyse(path: Path) -> int:
    """Recompute summaries, report and plot from a saved run's raw samples (no engines)."""
    saved = json.loads(path.read_text())
    name = saved.get("benchmark", path.stem)
    if saved.get("mode") == "nixl-fix-ab":
        report_fix_ab(saved["args"], saved["machine"], saved["arms"], name)
    else:
        dev = dict(saved.get("dev") or {}, samples=saved["samples"])
        report_full(saved["args"], saved["machine"], dev, saved.get("bare_engines"), name)
    return 0


async def run(args: argparse.Namespace) -> int:
    prompts = Prompts(seed=args.seed)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-bench-ttft-"))
    log(f"engine logs: {log_dir}")
    if args.mode == "nixl-fix-ab":
        if args.name == "ttft_breakdown":
            args.name = "ttft_nixl_fix_ab"
        return await run_fix_ab(args, prompts, log_dir)
    return await run_full(args, prompts, log_dir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reanalyse:
        return reanalyse(args.reanalyse)
    exit_on_sigterm()
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
