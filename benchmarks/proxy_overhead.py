"""What the proxy costs a request, measured side by side with calling the engine directly.

Two setups, each at concurrency 1 and 32, with a fixed number of requests per block; the arms of
a setup run as interleaved blocks (shuffled per repeat) so drift on a shared machine hits them
alike:

1. ``fake`` — a fast fake OpenAI engine (``tests/proxy/fake_engine.py``'s handlers served on a
   fixed port in a subprocess: a prefill reply at once, a decode stream of a few SSE events at
   once) behind the real proxy app run by uvicorn in another subprocess (``policy=disaggregate``,
   no warm-up: every request is two hops). Arms: ``direct`` (the client streams one request from
   the fake), ``direct_pd`` (the client does the prefill hop and the decode hop itself) and
   ``proxy``. The proxy's CPU time per request is read from ``/proc``.
2. ``real`` — ``pdserve dev`` on the tiny model (``--policy disaggregate``). Arms: ``direct_pd``
   (the client does P/D on the engines itself, with ``transport.kv_params``) and ``proxy``: the
   difference is the pure proxy cost on real engines. Fresh random prompts per request.

Targets (from the issue): <= 2 ms added TTFT at p50, and >= half the direct request rate at
concurrency 32. ``--profile`` adds one py-spy-sampled proxy block (fake setup, c=32, not counted)
and prints the proxy's hottest functions.

Run: ``python -m benchmarks.proxy_overhead`` (``--help`` for counts and ports).
Writes ``benchmarks/results/proxy_overhead.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import (
    ROOT,
    TINY_SERVED_NAME,
    Prompts,
    exit_on_sigterm,
    log,
    machine_info,
    save_results,
    summarize,
    timed_post,
    timed_stream,
    wait_ports_free,
)
from harness.stack import http_status, start_dev
from transport import kv_params

CHAT = "/v1/chat/completions"
TARGET_ADDED_TTFT_P50_MS = 2.0
TARGET_RATE_RATIO_C32 = 0.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.proxy_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,32", help="comma-separated levels")
    p.add_argument("--fake-requests", default="1000,4000",
                   help="requests per block for the fake setup, per concurrency level")
    p.add_argument("--real-requests", default="60,128",
                   help="requests per block for the real setup, per concurrency level")
    p.add_argument("--repeats", type=int, default=4, help="blocks per arm and level")
    p.add_argument("--fake-pairs", type=int, default=2000,
                   help="c=1 request pairs, arms alternating per request (fake setup)")
    p.add_argument("--real-pairs", type=int, default=300,
                   help="c=1 request pairs, arms alternating per request (real setup)")
    p.add_argument("--real-prompt-tokens", type=int, default=256)
    p.add_argument("--setups", default="fake,real", help="which setups to run")
    p.add_argument("--port", type=int, default=28000, help="proxy port (both setups)")
    p.add_argument("--fake-port", type=int, default=28200, help="the fake engine's port")
    p.add_argument("--engine-base-port", type=int, default=28100)
    p.add_argument("--side-channel-base-port", type=int, default=25600)
    p.add_argument("--kv-events-base-port", type=int, default=25700)
    p.add_argument("--profile", action="store_true",
                   help="py-spy the proxy during one extra fake c=32 block; print hot spots")
    p.add_argument("--profile-seconds", type=float, default=8.0)
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--name", default="proxy_overhead", help="results file name")
    # internal: the subprocesses this benchmark starts
    p.add_argument("--serve", choices=("fake", "proxy"), help=argparse.SUPPRESS)
    p.add_argument("--engine-url", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- the servers (subprocess entry points) ----------------------------------------------------


def serve_fake(port: int) -> None:
    """tests/proxy/fake_engine.py's handlers on a fixed port, uvloop, no access log."""
    from aiohttp import web

    from harness.fake_engine import FakeEngine

    _use_uvloop()

    class FastFake(FakeEngine):
        # Don't keep every request forever: this process serves thousands.
        async def _notify(self) -> None:
            if len(self.decode_requests) > 64:
                for lst in (self.prefill_requests, self.decode_requests, self.handoffs,
                            self.handoff_prompt_ids, self.sent_streams):
                    del lst[:-8]

    engine = FastFake(name="bench")
    app = web.Application()
    app.router.add_get("/health", engine._health)
    app.router.add_post("/v1/chat/completions", engine._completion)
    app.router.add_post("/v1/completions", engine._completion)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def serve_proxy(port: int, engine_url: str) -> None:
    """The real proxy app in front of one URL for both roles: every request takes two hops."""
    import uvicorn

    from proxy.app import create_app
    from proxy.config import ProxyConfig
    from proxy.server import uvicorn_config

    config = ProxyConfig(prefill_urls=(engine_url,), decode_urls=(engine_url,),
                         served_model_names=("m",), policy="disaggregate", warmup=False)
    uvicorn.Server(uvicorn_config(create_app(config), config, "127.0.0.1", port)).run()


def _use_uvloop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


class Server:
    """One of the above as a subprocess of this benchmark; ready when ``/health`` is 200."""

    def __init__(self, kind: str, port: int, log_dir: Path, engine_url: str | None = None):
        self.kind = kind
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "benchmarks.proxy_overhead", "--serve", kind,
                "--port", str(port)]
        if engine_url:
            argv += ["--engine-url", engine_url]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{kind}-{port}.log"
        with open(self.log_path, "wb") as out:
            self.popen = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while http_status(self.url + "/health", 1.0) != 200:
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{kind} server did not start: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- load generation --------------------------------------------------------------------------


Request = Callable[[aiohttp.ClientSession, int], Awaitable[dict[str, Any]]]


async def run_block(session: aiohttp.ClientSession, request: Request, n: int, concurrency: int,
                    cpu_pids: dict[str, int]) -> dict[str, Any]:
    """``n`` requests, ``concurrency`` at a time; TTFTs, wall time, rate and CPU per request."""
    next_i = 0
    results: list[dict[str, Any]] = []

    async def worker() -> None:
        nonlocal next_i
        while next_i < n:
            i = next_i
            next_i += 1
            results.append(await request(session, i))

    cpu0 = {k: cpu_seconds(p) for k, p in cpu_pids.items()}
    client0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    client1 = resource.getrusage(resource.RUSAGE_SELF)
    ok = [r for r in results if r.get("ok")]
    cpu = {k: (cpu_seconds(p) - cpu0[k]) / max(1, len(ok)) * 1e3 for k, p in cpu_pids.items()}
    cpu["client"] = ((client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime)
                     / max(1, len(ok)) * 1e3)
    return {
        "n": n,
        "concurrency": concurrency,
        "ok": len(ok),
        "errors": [r.get("error") for r in results if not r.get("ok")][:5],
        "wall_s": wall,
        "rate_rps": len(ok) / wall if wall else 0.0,
        "ttft_ms": [round(r["ttft_s"] * 1e3, 3) for r in ok],
        "total_ms": [round(r["total_s"] * 1e3, 3) for r in ok],
        "cpu_ms_per_request": cpu,
    }


def stream_arm(url: str, make_body: Callable[[int], dict[str, Any]]) -> Request:
    """One streamed request to ``url`` (an engine directly, or the proxy)."""
    async def request(session: aiohttp.ClientSession, i: int) -> dict[str, Any]:
        st = await timed_stream(session, url + CHAT, make_body(i))
        ok = st.status == 200 and not st.error and st.t_first_content is not None
        return {"ok": ok, "ttft_s": st.ttft_s, "total_s": st.t_done - st.t_sent,
                "error": st.error or (None if ok else f"status {st.status}"),
                "route": st.headers.get("x-pd-route")}
    return request


def direct_pd_arm(prefill_url: str, decode_url: str, make_body: Callable[[int], dict[str, Any]]
                  ) -> Request:
    """The client does what the proxy does: prefill hop (JSON), then the decode hop (stream)."""
    async def request(session: aiohttp.ClientSession, i: int) -> dict[str, Any]:
        body = make_body(i)
        pbody = dict(body, max_tokens=1, stream=False, return_token_ids=True)
        pbody[kv_params.BODY_KEY] = kv_params.prefill_request_params()
        t0 = time.perf_counter()
        try:
            reply = await timed_post(session, prefill_url + CHAT, pbody)
            if reply.status != 200:
                return {"ok": False, "error": f"prefill status {reply.status}"}
            handoff = kv_params.parse_prefill_reply(reply.body)
        except (aiohttp.ClientError, kv_params.HandoffError, TimeoutError) as exc:
            return {"ok": False, "error": f"prefill: {type(exc).__name__}: {exc}"}
        dbody = dict(body)
        dbody[kv_params.BODY_KEY] = kv_params.decode_request_params(handoff)
        st = await timed_stream(session, decode_url + CHAT, dbody)
        ok = st.status == 200 and not st.error and st.t_first_content is not None
        return {"ok": ok, "ttft_s": (st.t_first_content - t0) if ok else None,
                "total_s": st.t_done - t0, "error": st.error or (None if ok else st.status)}
    return request


async def run_pairs(session: aiohttp.ClientSession, arms: dict[str, Request], n: int,
                    rng: random.Random) -> dict[str, Any]:
    """``n`` rounds at c=1, each sending one request per arm in a shuffled order: every arm
    sees the same moments of the box, so drift between blocks cannot pass for proxy cost."""
    ttft: dict[str, list[float]] = {arm: [] for arm in arms}
    errors: list[str] = []
    for _ in range(n):
        order = list(arms)
        rng.shuffle(order)
        for arm in order:
            r = await arms[arm](session, len(ttft[arm]))
            if r.get("ok"):
                ttft[arm].append(round(r["ttft_s"] * 1e3, 3))
            else:
                errors.append(f"{arm}: {r.get('error')}")
    out: dict[str, Any] = {"rounds": n, "ttft_ms": ttft, "errors": errors[:5],
                           "failed": len(errors)}
    if "proxy" in ttft:
        for base in ("direct", "direct_pd"):
            if base in ttft:
                out[f"proxy_vs_{base}"] = {
                    "added_ttft_p50_ms": _sub(summarize(ttft["proxy"]).get("p50"),
                                              summarize(ttft[base]).get("p50")),
                    "added_ttft_p99_ms": _sub(summarize(ttft["proxy"]).get("p99"),
                                              summarize(ttft[base]).get("p99")),
                }
    return out


async def run_setup(name: str, arms: dict[str, Request], counts: dict[int, int], repeats: int,
                    cpu_pids: dict[str, int], seed: int | None, pairs: int = 0,
                    headers: dict[str, str] | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    blocks: list[dict[str, Any]] = []
    paired: dict[str, Any] | None = None
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        # one short unmeasured block per arm: connections, caches, first-request paths
        for arm, request in arms.items():
            await run_block(session, request, 8, 2, {})
        if pairs:
            paired = await run_pairs(session, arms, pairs, rng)
            log(f"[{name}] c=1 interleaved: {pairs} rounds, " + ", ".join(
                f"{arm} TTFT p50 {summarize(v).get('p50', 0):.2f} ms"
                for arm, v in paired["ttft_ms"].items()))
        for c, n in counts.items():
            for rep in range(repeats):
                order = list(arms)
                rng.shuffle(order)
                for arm in order:
                    b = await run_block(session, arms[arm], n, c, cpu_pids)
                    b.update(setup=name, arm=arm, repeat=rep)
                    blocks.append(b)
                    t = summarize(b["ttft_ms"])
                    log(f"[{name}] c={c:<3d} {arm:10s} rep {rep + 1}: {b['ok']}/{n} ok, "
                        f"{b['rate_rps']:7.1f} req/s, TTFT p50 {t.get('p50', 0):7.2f} ms p99 "
                        f"{t.get('p99', 0):7.2f} ms" + (f", errors {b['errors']}"
                                                        if b["errors"] else ""))
    summary = summarize_setup(blocks, list(arms), list(counts))
    if paired is not None:
        summary["1_interleaved"] = {
            **{arm: {"ttft_ms": summarize(v)} for arm, v in paired["ttft_ms"].items()},
            **{k: v for k, v in paired.items() if k.startswith("proxy_vs_")},
            "failed": paired["failed"],
        }
    return {"blocks": blocks, "paired": paired, "summary": summary}


def summarize_setup(blocks: list[dict[str, Any]], arms: list[str], levels: list[int]
                    ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in levels:
        per_arm = {}
        for arm in arms:
            bs = [b for b in blocks if b["arm"] == arm and b["concurrency"] == c]
            ttft = [x for b in bs for x in b["ttft_ms"]]
            ok = sum(b["ok"] for b in bs)
            wall = sum(b["wall_s"] for b in bs)
            cpu_keys = sorted({k for b in bs for k in b["cpu_ms_per_request"]})
            per_arm[arm] = {
                "ttft_ms": summarize(ttft),
                # median over blocks: one block hit by a neighbour's burst doesn't decide it
                "rate_rps": summarize([b["rate_rps"] for b in bs]).get("p50"),
                "rate_rps_pooled": ok / wall if wall else None,
                "rate_rps_per_block": [b["rate_rps"] for b in bs],
                "errors": sum(b["n"] - b["ok"] for b in bs),
                "cpu_ms_per_request": {
                    k: sum(b["cpu_ms_per_request"].get(k, 0) * b["ok"] for b in bs) / max(1, ok)
                    for k in cpu_keys},
            }
        out[str(c)] = per_arm
        if "proxy" in per_arm:
            for base in ("direct", "direct_pd"):
                if base not in per_arm:
                    continue
                a, b = per_arm["proxy"], per_arm[base]
                per_arm[f"proxy_vs_{base}"] = {
                    "added_ttft_p50_ms": _sub(a["ttft_ms"].get("p50"), b["ttft_ms"].get("p50")),
                    "added_ttft_p99_ms": _sub(a["ttft_ms"].get("p99"), b["ttft_ms"].get("p99")),
                    "rate_ratio": (a["rate_rps"] / b["rate_rps"]) if b["rate_rps"] else None,
                }
    return out


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


# --- profiling --------------------------------------------------------------------------------


async def profile_proxy(proxy: Server, request: Request, seconds: float, out_dir: Path
                        ) -> dict[str, Any]:
    """py-spy (raw collapsed stacks) on the proxy during a c=32 load; top self/inclusive frames."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return {"error": "py-spy not found (pip install py-spy)"}
    raw = out_dir / "proxy_overhead_profile.txt"
    cmd = [spy, "record", "--pid", str(proxy.pid), "--duration", str(int(seconds)),
           "--rate", "200", "--format", "raw", "--output", str(raw), "--nonblocking"]
    spy_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    await asyncio.sleep(1.0)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector) as session:
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end and spy_proc.poll() is None:
            await run_block(session, request, 200, 32, {})
    _, err = await asyncio.to_thread(spy_proc.communicate)
    if not raw.exists():
        return {"error": f"py-spy failed: {err.decode(errors='replace')[-500:]}"}
    return analyse_profile(raw)


_LINE_NO = re.compile(r":\d+\)$")


def analyse_profile(raw: Path, top: int = 15) -> dict[str, Any]:
    self_counts: collections.Counter[str] = collections.Counter()
    incl_counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        # "func (file.py:123)" -> "func (file.py)": aggregate per function, not per line
        frames = [_LINE_NO.sub(")", f) for f in stack.split(";")
                  if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += n
        self_counts[frames[-1]] += n
        for f in set(frames):
            incl_counts[f] += n
    pct = lambda c: round(100.0 * c / total, 1) if total else 0.0  # noqa: E731
    by_package: collections.Counter[str] = collections.Counter()
    for frame, c in self_counts.items():
        by_package[_package(frame)] += c
    ours = [(f, c) for f, c in incl_counts.most_common() if "proxy/" in f or "transport/" in f]
    return {
        "samples": total,
        "raw": str(raw),
        "self_by_package": {k: pct(c) for k, c in by_package.most_common()},
        "top_self": [{"frame": f, "pct": pct(c)} for f, c in self_counts.most_common(top)],
        "top_inclusive": [{"frame": f, "pct": pct(c)} for f, c in incl_counts.most_common(top)],
        "top_inclusive_pdserve": [{"frame": f, "pct": pct(c)} for f, c in ours[:top]],
    }


_PACKAGES = (("proxy/", "pdserve proxy"), ("transport/", "pdserve transport"),
             ("uvicorn/", "uvicorn (HTTP server)"), ("aiohttp/", "aiohttp (engine client)"),
             ("starlette/", "starlette/fastapi/anyio"), ("fastapi/", "starlette/fastapi/anyio"),
             ("anyio/", "starlette/fastapi/anyio"), ("prometheus_client/", "prometheus_client"),
             ("numpy/", "numpy"), ("pydantic", "pydantic"), ("json/", "json"),
             ("asyncio/", "event loop (asyncio/uvloop, incl. socket I/O)"))


def _package(frame: str) -> str:
    for needle, name in _PACKAGES:
        if needle in frame:
            return name
    return "other"


# --- setups -----------------------------------------------------------------------------------


def _counts(spec: str, levels: list[int]) -> dict[int, int]:
    ns = [int(x) for x in spec.split(",")]
    if len(ns) == 1:
        ns = ns * len(levels)
    return dict(zip(levels, ns))


async def fake_setup(args: argparse.Namespace, levels: list[int], log_dir: Path
                     ) -> dict[str, Any]:
    log(f"[fake] fake engine on :{args.fake_port}, proxy on :{args.port} (subprocesses)")
    fake = Server("fake", args.fake_port, log_dir)
    proxy = None
    try:
        proxy = Server("proxy", args.port, log_dir, engine_url=fake.url)

        def body(i: int) -> dict[str, Any]:
            return {"model": "m", "messages": [{"role": "user", "content": f"hello there {i}"}],
                    "max_tokens": 4, "stream": True}

        arms = {
            "direct": stream_arm(fake.url, body),
            "direct_pd": direct_pd_arm(fake.url, fake.url, body),
            "proxy": stream_arm(proxy.url, body),
        }
        result = await run_setup("fake", arms, _counts(args.fake_requests, levels), args.repeats,
                                 {"proxy": proxy.pid, "fake": fake.pid}, args.seed,
                                 pairs=args.fake_pairs if 1 in levels else 0)
        if args.profile:
            log(f"[fake] profiling the proxy with py-spy for {args.profile_seconds:.0f}s at c=32")
            result["profile"] = await profile_proxy(proxy, arms["proxy"], args.profile_seconds,
                                                    log_dir)
        return result
    finally:
        if proxy is not None:
            proxy.stop()
        fake.stop()


async def real_setup(args: argparse.Namespace, levels: list[int], log_dir: Path
                     ) -> dict[str, Any]:
    prompts = Prompts(seed=args.seed)
    counts = _counts(args.real_requests, levels)
    pairs = args.real_pairs if 1 in levels else 0
    need = (sum(counts.values()) * args.repeats + 16 + pairs) * 2
    log(f"[real] making {need} fresh {args.real_prompt_tokens}-token prompts")
    pool = [prompts.messages(args.real_prompt_tokens) for _ in range(need)]
    it = iter(pool)

    def body(_i: int) -> dict[str, Any]:
        return {"model": TINY_SERVED_NAME, "messages": next(it), "max_tokens": 4,
                "temperature": 0, "ignore_eos": True, "stream": True}

    waited = await wait_ports_free([
        args.port, args.engine_base_port, args.engine_base_port + 1, args.side_channel_base_port,
        args.side_channel_base_port + 1, args.kv_events_base_port, args.kv_events_base_port + 1])
    if waited > 1:
        log(f"[real] waited {waited:.0f}s for the ports to be free")
    log("[real] starting pdserve dev (tiny, --policy disaggregate) ...")
    stack = start_dev(log_dir=log_dir / "dev", port=args.port, policy="disaggregate",
                           engine_base_port=args.engine_base_port,
                           side_channel_base_port=args.side_channel_base_port,
                           kv_events_base_port=args.kv_events_base_port)
    try:
        log(f"[real] /health=200 after {stack.startup_s:.0f}s")
        arms = {
            "direct_pd": direct_pd_arm(stack.prefill_url, stack.decode_url, body),
            "proxy": stream_arm(stack.proxy_url, body),
        }
        return await run_setup("real", arms, counts, args.repeats,
                               {"proxy": stack.popen.pid}, args.seed, pairs=pairs,
                               headers=stack.engine_headers)
    finally:
        log("[real] stopping pdserve dev")
        stack.stop()


# --- report -----------------------------------------------------------------------------------


def print_report(results: dict[str, Any]) -> dict[str, Any]:
    verdicts: dict[str, Any] = {}
    for setup, res in results.items():
        if not isinstance(res, dict) or "summary" not in res:
            continue
        print(f"\nproxy overhead, setup '{setup}' (TTFT ms p50 / p99, requests/s = median "
              f"over blocks, CPU ms per request)", flush=True)
        for c, per_arm in res["summary"].items():
            if c == "1_interleaved":
                continue
            for arm, s in per_arm.items():
                if arm.startswith("proxy_vs_"):
                    continue
                t = s["ttft_ms"]
                cpu = ", ".join(f"{k} {v:.2f}" for k, v in s["cpu_ms_per_request"].items())
                print(f"  c={c:<3s} {arm:10s} TTFT {t.get('p50', 0):8.2f} / {t.get('p99', 0):8.2f}"
                      f"  {s['rate_rps'] or 0:8.1f} req/s  errors {s['errors']}  CPU ms/req: {cpu}",
                      flush=True)
            for arm, d in per_arm.items():
                if not arm.startswith("proxy_vs_"):
                    continue
                print(f"  c={c:<3s} {arm:18s} added TTFT p50 {d['added_ttft_p50_ms']:+7.2f} ms, "
                      f"p99 {d['added_ttft_p99_ms']:+8.2f} ms, rate x{d['rate_ratio']:.2f}",
                      flush=True)
        inter = res["summary"].get("1_interleaved")
        if inter:
            print(f"  c=1   interleaved per request, {res['paired']['rounds']} rounds: " + ", ".join(
                f"{arm} TTFT {s['ttft_ms'].get('p50', 0):.2f} / {s['ttft_ms'].get('p99', 0):.2f}"
                for arm, s in inter.items() if isinstance(s, dict) and "ttft_ms" in s)
                + f", failed {inter['failed']}", flush=True)
            for arm, d in inter.items():
                if arm.startswith("proxy_vs_"):
                    print(f"  c=1   {arm:18s} added TTFT p50 {d['added_ttft_p50_ms']:+7.2f} ms, "
                          f"p99 {d['added_ttft_p99_ms']:+8.2f} ms (interleaved)", flush=True)
        base = "direct" if any("proxy_vs_direct" in v for v in res["summary"].values()) \
            else "direct_pd"
        v: dict[str, Any] = {"baseline": base}
        # The c=1 verdict comes from the interleaved rounds when there are any.
        c1 = (inter or res["summary"].get("1", {})).get(f"proxy_vs_{base}")
        c32 = res["summary"].get("32", {}).get(f"proxy_vs_{base}")
        if c1:
            v["added_ttft_p50_ms_c1"] = c1["added_ttft_p50_ms"]
            v["ttft_target_met"] = c1["added_ttft_p50_ms"] <= TARGET_ADDED_TTFT_P50_MS
        if c32:
            v["rate_ratio_c32"] = c32["rate_ratio"]
            v["rate_target_met"] = c32["rate_ratio"] >= TARGET_RATE_RATIO_C32
        v["errors"] = {f"c={c} {arm}": s["errors"] for c, per_arm in res["summary"].items()
                       for arm, s in per_arm.items() if not arm.startswith("proxy_vs_")
                       and isinstance(s, dict) and s.get("errors")}
        if inter and inter["failed"]:
            v["errors"]["c=1 interleaved"] = inter["failed"]
        if v["errors"]:
            print(f"  FAILED requests: {v['errors']}", flush=True)
        verdicts[setup] = v
        print(f"  targets vs {base}: added TTFT p50 at c=1 <= {TARGET_ADDED_TTFT_P50_MS} ms -> "
              f"{_verdict(v.get('ttft_target_met'))}; rate at c=32 >= "
              f"{TARGET_RATE_RATIO_C32:.0%} of direct -> {_verdict(v.get('rate_target_met'))}",
              flush=True)
        prof = res.get("profile")
        if prof and "top_self" in prof:
            print(f"  py-spy on the proxy ({prof['samples']} samples, {prof['raw']}):", flush=True)
            print("    self time by package: " + ", ".join(
                f"{k} {v:.0f}%" for k, v in prof["self_by_package"].items()), flush=True)
            print("    top self time:", flush=True)
            for row in prof["top_self"][:10]:
                print(f"      {row['pct']:5.1f}%  {row['frame']}", flush=True)
            print("    top inclusive (pdserve code):", flush=True)
            for row in prof["top_inclusive_pdserve"][:10]:
                print(f"      {row['pct']:5.1f}%  {row['frame']}", flush=True)
    return verdicts


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("meets" if ok else "MISSES")


def plot(fig, results: dict[str, Any]) -> None:
    setups = [k for k, v in results.items() if isinstance(v, dict) and "summary" in v]
    for i, setup in enumerate(setups):
        summary = results[setup]["summary"]
        ax = fig.add_subplot(2, len(setups), 1 + i)
        labels, p50s, p99s = [], [], []
        rate_labels, rates = [], []
        for c, per_arm in summary.items():
            level = "c=1, interleaved" if c == "1_interleaved" else f"c={c}"
            for arm, s in per_arm.items():
                if arm.startswith("proxy_vs_") or not isinstance(s, dict):
                    continue
                labels.append(f"{level}\n{arm}")
                p50s.append(s["ttft_ms"].get("p50") or 0)
                p99s.append(s["ttft_ms"].get("p99") or 0)
                if "rate_rps" in s:
                    rate_labels.append(f"{level}\n{arm}")
                    rates.append(s["rate_rps"] or 0)
        x = range(len(labels))
        ax.bar([j - 0.2 for j in x], p50s, 0.4, label="p50")
        ax.bar([j + 0.2 for j in x], p99s, 0.4, label="p99")
        ax.set_xticks(list(x), labels, fontsize=6)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT ms (log)")
        ax.set_title(f"{setup}: TTFT")
        ax.legend(fontsize=7)
        ax = fig.add_subplot(2, len(setups), 1 + len(setups) + i)
        ax.bar(list(range(len(rates))), rates)
        ax.set_xticks(list(range(len(rates))), rate_labels, fontsize=6)
        ax.set_ylabel("requests/s")
        ax.set_title(f"{setup}: request rate (fixed request count per block)")


# --- main -------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> int:
    machine = machine_info()
    levels = [int(x) for x in args.concurrency.split(",")]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-bench-proxy-"))
    log(f"logs: {log_dir}")
    results: dict[str, Any] = {}
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if "fake" in setups:
        results["fake"] = await fake_setup(args, levels, log_dir)
    if "real" in setups:
        try:
            results["real"] = await real_setup(args, levels, log_dir)
        except (RuntimeError, OSError) as exc:  # keep what the fake setup measured
            log(f"[real] FAILED: {exc}"[:1000])
            results["real_error"] = str(exc)[:2000]
    verdicts = print_report(results)
    payload = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine,
        "targets": {"added_ttft_p50_ms": TARGET_ADDED_TTFT_P50_MS,
                    "rate_ratio_c32": TARGET_RATE_RATIO_C32},
        "verdicts": verdicts,
        "results": results,
    }
    json_path, png_path = save_results(args.name, payload, lambda fig: plot(fig, results))
    log(f"wrote {json_path} and {png_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve == "fake":
        serve_fake(args.port)
        return 0
    if args.serve == "proxy":
        serve_proxy(args.port, args.engine_url)
        return 0
    exit_on_sigterm()
    _use_uvloop()
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
