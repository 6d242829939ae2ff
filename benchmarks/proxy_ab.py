"""Two versions of the proxy side by side: the same fake engine behind a proxy served from this
tree and one served from another checkout (``--other DIR``, e.g. ``git worktree add /tmp/old
<commit>``), requests alternating between them at concurrency 1 in a shuffled order, so drift on
a shared box hits both alike. Reports added TTFT over the client doing both hops itself
(p50/p99) and each proxy's CPU per request.

Run: ``python -m benchmarks.proxy_ab --other /tmp/old [--pairs 2000]``.
Writes ``benchmarks/results/proxy_ab.json`` (no plot: two numbers a side).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import (
    ROOT,
    exit_on_sigterm,
    log,
    save_results,
    summarize,
    wait_ports_free,
)
from benchmarks.proxy_overhead import cpu_seconds, direct_pd_arm, stream_arm
from harness.stack import http_status

CONFIG = {"served_model_names": ["m"], "policy": "disaggregate", "warmup": False}


def serve(tree: Path, port: int, engine: str, log_dir: Path, name: str,
          extra: dict[str, Any] | None = None) -> subprocess.Popen:
    """The proxy app of ``tree`` (its own ``proxy`` package first on the path); ``extra``:
    more of its config."""
    code = ("import json, sys, uvicorn\n"
            "from proxy.app import create_app\nfrom proxy.config import ProxyConfig\n"
            "from proxy.server import uvicorn_config\n"
            "c = ProxyConfig(**json.loads(sys.argv[1]))\n"
            "uvicorn.Server(uvicorn_config(create_app(c), c, '127.0.0.1', int(sys.argv[2])))"
            ".run()\n")
    config = dict(CONFIG, prefill_urls=[engine], decode_urls=[engine], **(extra or {}))
    out = open(log_dir / f"{name}.log", "wb")
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(config), str(port)],
                            cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while http_status(f"http://127.0.0.1:{port}/health") != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start: {(log_dir / f'{name}.log').read_text()}")
        time.sleep(0.2)
    return proc


async def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = ROOT / ".pdserve" / "bench-proxy-ab"
    log_dir.mkdir(parents=True, exist_ok=True)
    # A proxy left on a port would answer for ours (and be measured as this tree).
    await wait_ports_free([args.fake_port, args.port, args.port + 1])
    fake = subprocess.Popen([sys.executable, "-m", "benchmarks.proxy_overhead", "--serve", "fake",
                             "--port", str(args.fake_port)], cwd=ROOT,
                            stdout=open(log_dir / "fake.log", "wb"), stderr=subprocess.STDOUT)
    engine = f"http://127.0.0.1:{args.fake_port}"
    procs = {}
    try:
        while http_status(engine + "/health") != 200:
            time.sleep(0.1)
        procs = {"this": serve(Path(args.this), args.port, engine, log_dir, "this",
                               json.loads(args.this_config)),
                 "other": serve(Path(args.other), args.port + 1, engine, log_dir, "other")}
        urls = {"this": f"http://127.0.0.1:{args.port}",
                "other": f"http://127.0.0.1:{args.port + 1}"}
        ttft: dict[str, list[float]] = {"this": [], "other": [], "direct_pd": []}
        cpu: dict[str, float] = {"this": 0.0, "other": 0.0}
        rng = random.Random(args.seed)
        def body(i: int) -> dict[str, Any]:
            return {"model": "m", "stream": True, "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"say hello, request {i}"}]}

        arms = {name: stream_arm(url, body) for name, url in urls.items()}
        arms["direct_pd"] = direct_pd_arm(engine, engine, body)
        async with aiohttp.ClientSession() as session:
            for i in range(200):  # warm both up
                for name in urls:
                    await arms[name](session, i)
            for i in range(args.pairs):
                order = ["this", "other", "direct_pd"]
                rng.shuffle(order)
                for arm in order:
                    c0 = cpu_seconds(procs[arm].pid) if arm in procs else 0.0
                    r = await arms[arm](session, i)
                    if arm in procs:
                        cpu[arm] += cpu_seconds(procs[arm].pid) - c0
                    if r.get("ok"):
                        ttft[arm].append(r["ttft_s"])
                if i and i % 500 == 0:
                    log(f"{i}/{args.pairs} pairs")
        base = sorted(ttft["direct_pd"])
        out: dict[str, Any] = {"pairs": args.pairs, "other": args.other, "this_tree": args.this,
                               "this_config": json.loads(args.this_config)}
        for arm in ("this", "other"):
            xs = sorted(ttft[arm])
            out[arm] = {"ttft_ms": summarize(xs, 1e3),
                        "added_p50_ms": (xs[len(xs) // 2] - base[len(base) // 2]) * 1e3,
                        "added_p99_ms": (xs[int(0.99 * len(xs))] - base[int(0.99 * len(base))])
                        * 1e3,
                        "cpu_ms_per_request": cpu[arm] / args.pairs * 1e3}
            log(f"{arm:5s}: added TTFT p50 {out[arm]['added_p50_ms']:+.2f} ms, p99 "
                f"{out[arm]['added_p99_ms']:+.2f} ms; CPU {out[arm]['cpu_ms_per_request']:.2f} "
                "ms/request")
        return out
    finally:
        for p in [*procs.values(), fake]:
            p.terminate()
            p.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.proxy_ab", description=__doc__)
    p.add_argument("--other", required=True, help="another checkout of pdserve")
    p.add_argument("--this", default=str(ROOT),
                   help="the checkout measured as 'this' (default: this tree; bisecting)")
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--port", type=int, default=28050)
    p.add_argument("--fake-port", type=int, default=28250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--this-config", default="{}",
                   help='JSON: more ProxyConfig for this tree, e.g. {"migration_limit": 0}')
    p.add_argument("--name", default="proxy_ab")
    args = p.parse_args(argv)
    exit_on_sigterm()
    results = asyncio.run(run(args))
    path, _ = save_results(args.name, results, None)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
