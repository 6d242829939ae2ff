"""Stream migration, measured: a decode engine killed under concurrent greedy streams.

Ray mode on a local cluster, one prefill and two decode engines (the tiny model). Each run:
the same ``--streams`` greedy streams (the official ``openai`` client) once uninterrupted (the
reference), then again with decode-0's vLLM server (``--kill engine_core``: only its engine
core) SIGKILLed once every stream has ``--kill-after`` chunks; then wait until Ray has
restarted it and the proxy sees it healthy. Reported per run: streams completed, texts equal to
the reference, migrations the proxy counted, the gap each stream saw across the kill (its two
sides: the last chunk before the kill, the first after), and the proxy's own
``pd_migration_seconds`` (the loss seen to the continuation's headers and first bytes: what
is left of the gap is the kill's own time to be seen). ``--trace`` adds each continuation's
stages from the proxy's and the engines' traces (``continuation_stages``). The streams that
were on the killed engine are the ones the proxy migrated; the client cannot tell which they
were, so the ``migrated`` largest gaps across the kill are taken as theirs (the others only
see their engine take the continuations in).

What a migrated stream's gap is compared with: one local prefill of a continuation (the prompt
plus the chunks delivered by the kill, a fresh prompt each time so nothing is cached), timed on
the surviving decode engine alone, after the run.

Run: ``python -m benchmarks.migration [--runs 3] [--streams 8] [--policy P] [--kill K]
[--trace] [--name N]``. Writes ``benchmarks/results/<N>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import exit_on_sigterm, log, save_results
from harness.engine_io import proxy_metric
from harness.greedy_streams import greedy_streams
from harness.otlp_receiver import OtlpReceiver, ReceivedSpan
from harness.prompts import text_of_tokens
from harness.stack import start_ray

#: How long after the kill a stream's break may end and still count as the migration's.
KILL_WINDOW_S = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--kill-after", type=int, default=8, help="chunks every stream has first")
    p.add_argument("--policy", default="auto",
                   help="the proxy's policy (disaggregate: every stream's prompt is prefilled"
                   " on the prefill engine, whose prefix cache then holds it for a"
                   " continuation)")
    p.add_argument("--kill", choices=("server", "engine_core"), default="server",
                   help="what dies: decode-0's vLLM server (its connections drop), or only its"
                   " engine core (the server then ends each stream with an in-band error)")
    p.add_argument("--trace", action="store_true",
                   help="trace the proxy and engines (OTLP): each continuation's stages")
    p.add_argument("--port", type=int, default=19400)
    p.add_argument("--name", default="migration")
    return p.parse_args(argv)


def decodes(proxy_url: str) -> dict[str, dict[str, Any]]:
    engines = httpx.get(proxy_url + "/pd/costs", timeout=10).json()["engines"]
    return {n: e for n, e in engines.items() if e["role"] == "decode"}


def listener_pid(url: str) -> int:
    import psutil

    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise RuntimeError(f"nothing listens on {url}")


def wait_until(pred, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.5)


def idle(proxy_url: str) -> bool:
    return all(not e["load_tokens"] and not e["engine_requests"] and e["healthy"]
               and not e["warming"] for e in decodes(proxy_url).values())


def local_prefill_s(url: str, model: str, tokens: int, seed: int, headers: dict[str, str]
                    ) -> float:
    """One prompt of ``tokens`` computed by the engine at ``url`` alone (max_tokens 1)."""
    body = {"model": model, "prompt": text_of_tokens(tokens, seed=seed), "max_tokens": 1}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=120, headers=headers)
    r.raise_for_status()
    return time.perf_counter() - t0


def decisions(proxy_url: str) -> dict[str, float]:
    """``pd_decisions_total`` by "route/reason"."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(proxy_url + "/metrics", timeout=10).text
    return {f"{s.labels['route']}/{s.labels['reason']}": s.value
            for fam in text_string_to_metric_families(text) if fam.name == "pd_decisions"
            for s in fam.samples if s.name == "pd_decisions_total"}


def migration_stages(proxy_url: str) -> dict[str, tuple[float, float]]:
    """``pd_migration_seconds`` by stage: (sum, count)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(proxy_url + "/metrics", timeout=10).text
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "pd_migration_seconds":
            for s in fam.samples:
                if s.name.endswith("_sum"):
                    out.setdefault(s.labels["stage"], [0.0, 0.0])[0] = s.value
                elif s.name.endswith("_count"):
                    out.setdefault(s.labels["stage"], [0.0, 0.0])[1] = s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


async def concurrent_prefills(url: str, model: str, tokens: int, seed: int, n: int,
                              headers: dict[str, str]) -> list[float]:
    """``n`` fresh prompts of ``tokens`` sent to the engine at ``url`` at once (max_tokens 1):
    each one's seconds to its answer."""
    async def one(client: httpx.AsyncClient, k: int) -> float:
        body = {"model": model, "prompt": text_of_tokens(tokens, seed=seed + k),
                "max_tokens": 1}
        t0 = time.perf_counter()
        r = await client.post(url + "/v1/completions", json=body, timeout=120, headers=headers)
        r.raise_for_status()
        return time.perf_counter() - t0

    async with httpx.AsyncClient() as client:
        return list(await asyncio.gather(*(one(client, k) for k in range(n))))


def one_run(stack, args: argparse.Namespace, run: int) -> dict[str, Any]:
    prompts = [text_of_tokens(args.prompt_tokens, seed=1000 * run + i)
               for i in range(args.streams)]
    url = stack.proxy_url

    def streams(kill=None):
        return asyncio.run(greedy_streams(url, stack.model_name, prompts, args.max_tokens,
                                          kill=kill, kill_after=args.kill_after))

    wait_until(lambda: idle(url), "decodes idle", 120)
    reference = streams()
    wait_until(lambda: idle(url), "decodes idle", 120)
    victim = decodes(url)["decode-0"]
    pid = listener_pid(victim["url"])
    if args.kill == "engine_core":
        import psutil

        (pid,) = [p.pid for p in psutil.Process(pid).children()
                  if p.name().startswith("VLLM::EngineCor")]
    t_kill = t_kill_wall = 0.0

    def kill() -> None:
        nonlocal t_kill
        nonlocal t_kill_wall
        os.kill(pid, signal.SIGKILL)
        t_kill = time.perf_counter()
        t_kill_wall = time.time()

    reason = "decode_lost" if args.kill == "server" else "decode_error"
    before = proxy_metric(url, "pd_migrations_total", reason=reason)
    stages_before = migration_stages(url)
    decided = decisions(url)
    killed = streams(kill)
    migrated = int(proxy_metric(url, "pd_migrations_total", reason=reason) - before)
    # The proxy's own clock: loss seen -> continuation's headers / its first bytes (means).
    in_proxy = {stage: (s - stages_before.get(stage, (0.0, 0.0))[0])
                / max(1.0, n - stages_before.get(stage, (0.0, 0.0))[1])
                for stage, (s, n) in migration_stages(url).items()}
    # The streams' own plans plus the continuations': which route the continuations took.
    routes = {k: v - decided.get(k, 0.0) for k, v in decisions(url).items()
              if v - decided.get(k, 0.0) > 0}
    across, sides = [], []
    for r in killed:
        # The longest gap ending within KILL_WINDOW_S of the kill: the killed engine's socket
        # may still deliver what it had written before the kill, so the stream's break can
        # start a little after it.
        spans = [(a, b) for a, b in zip(r.times, r.times[1:])
                 if t_kill <= b <= t_kill + KILL_WINDOW_S]
        a, b = max(spans, key=lambda ab: ab[1] - ab[0]) if spans else (t_kill, t_kill)
        across.append(b - a)
        sides.append((t_kill - a, b - t_kill))  # its start (before the kill: > 0) and end
    survivor = decodes(url)["decode-1"]["url"]
    prefill = [local_prefill_s(survivor, stack.model_name,
                               args.prompt_tokens + args.kill_after, 90_000 + 10 * run + k,
                               stack.engine_headers)
               for k in range(5)]
    # All the continuations at once on the survivor (what it must compute when they all
    # move together), each timed to its own first token.
    together = asyncio.run(concurrent_prefills(
        survivor, stack.model_name, args.prompt_tokens + args.kill_after, 95_000 + 10 * run,
        max(1, migrated), stack.engine_headers))
    out = {
        "run": run,
        "decisions_during_kill_run": routes,
        "continuations_prefilled_together_s": together,
        "completed": sum(r.finish == "length" for r in killed),
        "same_text": sum(a.text == b.text for a, b in zip(reference, killed)),
        "migrated": migrated,
        "gap_across_kill_s": across,
        "migrated_gaps_s": sorted(across, reverse=True)[:migrated],
        "migrated_gap_sides_s": sorted(sides, key=sum, reverse=True)[:migrated],
        "chunk_times_from_kill_s": [[round(t - t_kill, 4) for t in r.times] for r in killed],
        "kill_wall_time": t_kill_wall,
        # Mean, per migrated stream, of the proxy's pd_migration_seconds by stage.
        "proxy_loss_to_resumed_s": in_proxy.get("resumed", 0.0),
        "proxy_loss_to_first_token_s": in_proxy.get("first_token", 0.0),
        "median_gap_at_rest_s": statistics.median(g for r in reference for g in r.gaps()),
        "local_prefill_of_continuation_s": statistics.median(prefill),
    }
    log(f"run {run}: {out['completed']}/{args.streams} completed, {out['same_text']} same "
        f"text, {migrated} migrated; migrated gaps {[round(g, 3) for g in out['migrated_gaps_s']]}"
        f" s; one local prefill of a continuation {out['local_prefill_of_continuation_s']:.3f} s"
        f", {migrated} at once {[round(t, 3) for t in together]} s; in the proxy, loss to "
        f"headers {out['proxy_loss_to_resumed_s']:.3f} s, to first token "
        f"{out['proxy_loss_to_first_token_s']:.3f} s; decisions {routes}")
    t0 = time.monotonic()
    wait_until(lambda: (decodes(url).get("decode-0") or {}).get("instance")
               not in (None, victim["instance"]) and decodes(url)["decode-0"]["healthy"],
               "decode-0 restarted", 600)
    out["restart_s"] = time.monotonic() - t0
    return out


def continuation_stages(spans: list[ReceivedSpan]) -> list[dict[str, Any]]:
    """Each continuation's stages, in ms, from the traces (a migrated stream's trace holds a
    second ``decision``): the lost relay's end to the continuation's plan, the plan to its
    decode request (a prefill leg in between when disaggregated), that request to its first
    byte; and, from the surviving engine's own ``llm_request`` span, its time in queue, in the
    model's prefill, and its time to first token."""
    traces: dict[str, list[ReceivedSpan]] = {}
    for s in spans:
        traces.setdefault(s.trace_id, []).append(s)
    out = []
    for trace in traces.values():
        decisions = sorted((s for s in trace if s.name == "decision"), key=lambda s: s.start_ns)
        if len(decisions) < 2:
            continue
        t_plan = decisions[1].start_ns
        lost = min((s for s in trace if s.name == "relay"), key=lambda s: s.start_ns)
        decode = min((s for s in trace if s.name == "decode" and s.start_ns >= t_plan),
                     key=lambda s: s.start_ns)
        engine = [s.attributes for s in trace
                  if s.name == "llm_request" and s.start_ns >= decode.start_ns]
        latency = engine[-1] if engine else {}
        out.append({
            "route": decisions[1].attributes.get("pd.route"),
            "lost_to_plan_ms": round((t_plan - lost.end_ns) / 1e6, 2),
            "plan_to_decode_sent_ms": round((decode.start_ns - t_plan) / 1e6, 1),
            "decode_sent_to_first_byte_ms": round((decode.end_ns - decode.start_ns) / 1e6, 1),
            "engine_queue_ms": round(1e3 * latency.get("gen_ai.latency.time_in_queue", 0), 1),
            "engine_prefill_ms": round(
                1e3 * latency.get("gen_ai.latency.time_in_model_prefill", 0), 1),
            "engine_ttft_ms": round(
                1e3 * latency.get("gen_ai.latency.time_to_first_token", 0), 1),
        })
    return out


def plot(results: dict[str, Any]):
    def draw(fig) -> None:
        ax = fig.add_subplot(1, 1, 1)
        for r in results["runs"]:
            gaps = r["migrated_gaps_s"]
            ax.scatter([r["run"]] * len(gaps), [1e3 * g for g in gaps], color="C0",
                       label="migrated stream's gap across the kill" if r["run"] == 0 else None)
            ax.scatter([r["run"]], [1e3 * r["local_prefill_of_continuation_s"]], marker="x",
                       color="C3", s=80,
                       label="one local prefill of a continuation" if r["run"] == 0 else None)
        ax.set_xlabel("run")
        ax.set_ylabel("ms")
        ax.set_title(f"stream migration: decode-0 killed under {results['streams']} greedy "
                     "streams (Ray, 1P+2D, tiny)")
        ax.legend()
    return draw


def main(argv: list[str] | None = None) -> None:
    exit_on_sigterm()
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-migration-"))
    log(f"starting pdserve ray (1P+2D, tiny, --policy {args.policy}, kill {args.kill}); "
        f"logs in {log_dir}")
    with contextlib.ExitStack() as cleanup:
        tracing: list[str] = []
        env: dict[str, str] = {}
        if args.trace:
            otlp = cleanup.enter_context(OtlpReceiver())
            tracing = ["--otlp-traces-endpoint", otlp.endpoint]
            env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                   "OTEL_BSP_SCHEDULE_DELAY": "200"}
        stack = start_ray("tiny", port=args.port, log_dir=log_dir,
                          extra=["--prefill", "1", "--decode", "2", "--num-cpus", "4",
                                 "--namespace", f"pdserve-bench-{os.getpid()}",
                                 "--kv-cache-gib", "1", "--policy", args.policy, *tracing],
                          progress=log, env=env)
        cleanup.callback(stack.stop)
        runs = [one_run(stack, args, run) for run in range(args.runs)]
        continuations = []
        if args.trace:
            time.sleep(2.0)  # the last exports
            continuations = continuation_stages(otlp.spans)
            for c in continuations:
                log("continuation: " + ", ".join(f"{k} {v}" for k, v in c.items()))
    migrated = [g for r in runs for g in r["migrated_gaps_s"]]
    prefills = [r["local_prefill_of_continuation_s"] for r in runs]
    results = {
        "config": vars(args), "streams": args.streams, "runs": runs,
        "continuations_traced": continuations,
        "summary": {
            "completed": f"{sum(r['completed'] for r in runs)}/{args.streams * args.runs}",
            "same_text": f"{sum(r['same_text'] for r in runs)}/{args.streams * args.runs}",
            "median_migrated_gap_s": statistics.median(migrated) if migrated else None,
            "median_local_prefill_s": statistics.median(prefills),
            "median_prefilled_together_s": statistics.median(
                t for r in runs for t in r["continuations_prefilled_together_s"]),
            "gap_over_prefill": (statistics.median(migrated) / statistics.median(prefills)
                                 if migrated else None),
        },
    }
    log(f"summary: {results['summary']}")
    save_results(args.name, results, plot(results))


if __name__ == "__main__":
    main()
