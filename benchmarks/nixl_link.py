"""How fast NIXL moves KV between two processes on one node, per UCX transport list, against raw
UCX on the same transports (issue 18: the link a pair's KV takes, chosen per pair).

Per arm (a ``UCX_TLS`` value) and round, shuffled so the arms interleave:

- **nixl**: two fresh processes with the arm's environment. The target registers ``--mib`` MiB of
  host memory cut into ``--block-kib`` KiB descriptors (vLLM's NIXL reads are many block-sized
  descriptors, not one buffer); the initiator READs all of them ``--reps`` times, each transfer
  timed from post to DONE, its state checked in a busy loop or every ``--poll-us`` (a vLLM
  engine checks once a step: on two cores a busy loop takes the transfer's CPU). Its agents
  get the progress-thread delay pdserve's engines use (``transport/nixl_cpu.py``), so the
  transport is measured as the engines run it.
- **ucx**: ``ucx_perftest -t ucp_get`` of the same total size (one message, or with
  ``--ucx-in-blocks`` messages of ``--block-kib`` each, the pieces NIXL moves), server and
  client with the same environment (the ``ucx_perftest`` of the ``libucx-cu12`` wheel:
  ``pip install libucx-cu12``; without it this arm is left out and the output says so).

Reported per arm: each side's GB/s (median and range over every timed transfer of every round)
and nixl ÷ ucx (target ≥ 0.6). ``UCX_NET_DEVICES=lo`` throughout, as dev mode sets it.

Run: ``python -m benchmarks.nixl_link`` (``--help``). Writes ``benchmarks/results/nixl_link.json``
and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import exit_on_sigterm, log, percentile, save_results

DEFAULT_TLS = ("tcp,self", "tcp,cma,self", "cma,self")
#: The delay pdserve's engines give NIXL's progress thread (transport/nixl_cpu.py, launch).
PROGRESS_DELAY_US = 1000
DELAY_ENV = "PDSERVE_BENCH_NIXL_DELAY_US"  # parent -> role processes (--progress-delay-us)
POLL_ENV = "PDSERVE_BENCH_NIXL_POLL_US"  # parent -> initiator (--poll-us)
READY_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 300.0


# --- the two NIXL roles, each run in its own process ------------------------------------------


def _agent(name: str):
    import nixl._api as api

    delay_us = int(os.environ.get(DELAY_ENV, PROGRESS_DELAY_US))
    # What transport/nixl_cpu.py's install_progress_delay does in the engines (imported from
    # there, it would load vLLM into both processes).
    real = api.nixlBind.nixlAgent

    def make_agent(agent_name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return real(agent_name, config)

    api.nixlBind.nixlAgent = make_agent
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _blocks(buf, block_bytes: int) -> list[tuple[int, int, int]]:
    base, total = buf.data_ptr(), buf.numel()
    return [(base + off, min(block_bytes, total - off), 0) for off in range(0, total, block_bytes)]


def run_target(workdir: Path, mib: int, block_kib: int) -> None:
    """Register the buffer, publish metadata and descriptors, wait for the initiator's done."""
    import torch

    agent = _agent("target")
    buf = torch.full((mib << 20,), 7, dtype=torch.uint8)
    agent.register_memory(buf)
    descs = agent.get_xfer_descs(_blocks(buf, block_kib << 10), "DRAM")
    (workdir / "meta.bin").write_bytes(agent.get_agent_metadata())
    (workdir / "descs.bin").write_bytes(agent.get_serialized_descs(descs))
    (workdir / "ready").touch()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (workdir / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def run_initiator(workdir: Path, mib: int, block_kib: int, reps: int) -> None:
    """READ the target's blocks ``reps`` times (plus one warm-up); print the seconds of each."""
    import torch

    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (workdir / "ready").exists():
        if time.monotonic() > deadline:
            raise SystemExit("the target never published its metadata")
        time.sleep(0.05)
    agent = _agent("initiator")
    buf = torch.zeros((mib << 20,), dtype=torch.uint8)
    agent.register_memory(buf)
    local = agent.get_xfer_descs(_blocks(buf, block_kib << 10), "DRAM")
    remote_name = agent.add_remote_agent((workdir / "meta.bin").read_bytes())
    remote = agent.deserialize_descs((workdir / "descs.bin").read_bytes())
    handle = agent.initialize_xfer("READ", local, remote, remote_name)
    poll_s = int(os.environ.get(POLL_ENV, "0")) / 1e6  # between state checks; 0: busy
    seconds = []
    try:
        for i in range(reps + 1):
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC":
                if time.perf_counter() - t0 > RUN_TIMEOUT_S:
                    raise SystemExit("a transfer did not finish")
                if poll_s:
                    time.sleep(poll_s)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise SystemExit(f"transfer failed: {state}")
            if i:  # the first one connects and warms up
                seconds.append(time.perf_counter() - t0)
        if int(buf[-1]) != 7:
            raise SystemExit("the bytes read are not the target's")
    finally:
        agent.release_xfer_handle(handle)
        (workdir / "done").touch()
    print(json.dumps({"seconds": seconds}))


# --- the benchmark ----------------------------------------------------------------------------


def arm_env(tls: str, delay_us: int = PROGRESS_DELAY_US, poll_us: int = 0) -> dict[str, str]:
    env = dict(os.environ, UCX_TLS=tls, UCX_NET_DEVICES="lo")
    env[DELAY_ENV], env[POLL_ENV] = str(delay_us), str(poll_us)
    env.pop("UCX_LOG_LEVEL", None)
    return env


def nixl_rates(tls: str, mib: int, block_kib: int, reps: int, delay_us: int,
               poll_us: int = 0) -> list[float]:
    """GB/s of each timed NIXL READ, or raises RuntimeError with the processes' error."""
    with tempfile.TemporaryDirectory(prefix="pdserve-nixl-link-") as tmp:
        workdir = Path(tmp)
        me = [sys.executable, "-m", "benchmarks.nixl_link", "--workdir", tmp, "--mib", str(mib),
              "--block-kib", str(block_kib)]
        env = arm_env(tls, delay_us, poll_us)
        target = subprocess.Popen([*me, "--role", "target"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not (workdir / "ready").exists():
                if target.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the target did not start: "
                                       + _last_lines(target.communicate(timeout=30)[1]))
                time.sleep(0.05)
            done = subprocess.run([*me, "--role", "initiator", "--reps", str(reps)], env=env,
                                  capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        finally:
            (workdir / "done").touch()
            try:
                _, target_err = target.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                target.kill()
                _, target_err = target.communicate()
        if done.returncode != 0:
            raise RuntimeError(_last_lines(done.stderr) or _last_lines(target_err))
        seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
        return [(mib << 20) / s / 1e9 for s in seconds]


def ucx_perftest() -> str | None:
    """The ``ucx_perftest`` binary: on PATH, or shipped by the ``libucx-cu12`` wheel."""
    if found := shutil.which("ucx_perftest"):
        return found
    try:
        import libucx  # type: ignore[import-not-found]
    except ImportError:
        return None
    candidate = Path(libucx.__file__).parent / "bin" / "ucx_perftest"
    return str(candidate) if candidate.exists() else None


def ucx_rates(binary: str, tls: str, mib: int, reps: int, port: int,
              block_kib: int | None = None) -> list[float]:
    """Raw UCX GB/s: ``ucx_perftest -t ucp_get`` of ``mib`` MiB, ``reps`` iterations (one
    figure: its average over them), or raises RuntimeError with its error. ``block_kib``: in
    messages of that size (as many iterations as moves the same bytes), not one."""
    size, iters = mib << 20, reps
    if block_kib:
        size, iters = block_kib << 10, reps * max(1, (mib << 10) // block_kib)
    env = arm_env(tls)
    lib = Path(binary).parent.parent / "lib"
    env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    server = subprocess.Popen([binary, "-p", str(port)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        client = subprocess.run(
            [binary, "127.0.0.1", "-p", str(port), "-t", "ucp_get", "-s", str(size),
             "-n", str(iters), "-w", "1"], env=env, capture_output=True, text=True,
            timeout=RUN_TIMEOUT_S)
    finally:
        server.terminate()
        try:
            server.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
    if client.returncode != 0:
        raise RuntimeError(_last_lines(client.stderr + client.stdout))
    return [parse_perftest_mb_s(client.stdout) * (1 << 20) / 1e9]


def parse_perftest_mb_s(text: str) -> float:
    """The average bandwidth (MB/s) of ``ucx_perftest``'s last result row."""
    rows = [line for line in text.splitlines() if re.match(r"^\s*(Final:|\d+\s)", line)]
    if not rows:
        raise RuntimeError(f"no result row in ucx_perftest's output: {_last_lines(text)}")
    fields = rows[-1].replace("Final:", "").split()
    # iterations, latency typical/average/overall (us), bandwidth average/overall (MB/s), ...
    return float(fields[5])


def _last_lines(text: str, n: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])


def summary(rates: list[float]) -> dict[str, Any]:
    return {"n": len(rates), "p50": percentile(rates, 50), "min": min(rates, default=None),
            "max": max(rates, default=None)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    binary = ucx_perftest()
    if binary is None:
        log("no ucx_perftest (pip install libucx-cu12): raw UCX left out")
    samples: dict[str, dict[str, list[float]]] = {t: {"nixl": [], "ucx": []} for t in args.tls}
    errors: dict[str, dict[str, str]] = {t: {} for t in args.tls}
    rng = random.Random(args.seed)
    port = args.port
    for r in range(args.rounds):
        order = [(t, side) for t in args.tls for side in ("nixl", "ucx") if side == "nixl"
                 or binary is not None]
        rng.shuffle(order)
        for tls, side in order:
            if side in errors[tls]:
                continue
            try:
                if side == "nixl":
                    got = nixl_rates(tls, args.mib, args.block_kib, args.reps,
                                     args.progress_delay_us, args.poll_us)
                else:
                    port += 1
                    assert binary is not None
                    got = ucx_rates(binary, tls, args.mib, args.reps, port,
                                    args.block_kib if args.ucx_in_blocks else None)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                errors[tls][side] = str(exc)[:400]
                log(f"round {r + 1}: {tls} {side} failed: {errors[tls][side]}")
                continue
            samples[tls][side] += got
            log(f"round {r + 1}/{args.rounds}: {tls:14} {side}: p50 {percentile(got, 50):.2f} GB/s")
    arms = {}
    for tls in args.tls:
        nixl, ucx = summary(samples[tls]["nixl"]), summary(samples[tls]["ucx"])
        ratio = (nixl["p50"] / ucx["p50"]) if nixl.get("p50") and ucx.get("p50") else None
        arms[tls] = {"nixl_gb_s": nixl, "ucx_gb_s": ucx, "nixl_over_ucx": ratio,
                     "samples": samples[tls], "errors": errors[tls]}
    return {"config": vars(args), "ucx_perftest": binary, "arms": arms}


def report(result: dict[str, Any]) -> None:
    print(f"{'UCX_TLS':16} {'nixl GB/s p50 [min-max]':28} {'ucx GB/s p50 [min-max]':28} nixl/ucx")
    for tls, arm in result["arms"].items():
        cells = []
        for side in ("nixl_gb_s", "ucx_gb_s"):
            s = arm[side]
            err = arm["errors"].get(side.split("_")[0])
            cells.append(f"{s['p50']:.2f} [{s['min']:.2f}-{s['max']:.2f}]" if s["n"]
                         else ("failed" if err else "n/a"))
        ratio = arm["nixl_over_ucx"]
        print(f"{tls:16} {cells[0]:28} {cells[1]:28} {ratio:.2f}" if ratio is not None
              else f"{tls:16} {cells[0]:28} {cells[1]:28} -")
        for side, err in arm["errors"].items():
            print(f"  {side} failed: {err}")


def plot(result: dict[str, Any]):
    def draw(fig) -> None:
        ax = fig.add_subplot(1, 1, 1)
        tls = list(result["arms"])
        for i, t in enumerate(tls):
            for j, side in enumerate(("nixl", "ucx")):
                ys = result["arms"][t]["samples"][side]
                ax.scatter([i + (j - 0.5) * 0.3] * len(ys), ys, s=12,
                           color=("tab:blue", "tab:orange")[j],
                           label=side if i == 0 else None)
        ax.set_xticks(range(len(tls)), tls)
        ax.set_xlabel("UCX_TLS")
        ax.set_ylabel("GB/s (each timed transfer; ucx: each run's average)")
        cfg = result["config"]
        ax.set_title(f"NIXL READ vs raw UCX get, one node: {cfg['mib']} MiB in "
                     f"{cfg['block_kib']} KiB blocks, {cfg['rounds']} rounds")
        ax.legend()
    return draw


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tls", nargs="+", default=list(DEFAULT_TLS), help="UCX_TLS values (arms)")
    p.add_argument("--mib", type=int, default=64, help="bytes moved per transfer, MiB")
    p.add_argument("--block-kib", type=int, default=64, help="descriptor size, KiB")
    p.add_argument("--reps", type=int, default=10, help="timed transfers per process pair")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--progress-delay-us", type=int, default=PROGRESS_DELAY_US,
                   help="NIXL progress thread's poll delay (0: nixl's own busy spin)")
    p.add_argument("--poll-us", type=int, default=0,
                   help="the initiator's sleep between state checks (0: a busy loop; a vLLM "
                        "engine checks once a step)")
    p.add_argument("--ucx-in-blocks", action="store_true",
                   help="raw UCX moves the bytes in --block-kib messages, as NIXL does (default: "
                        "one message of --mib). ucx_perftest reads one buffer each time: a "
                        "message the CPU caches is read from there (cma: 21 GB/s at 64 KiB)")
    p.add_argument("--port", type=int, default=23600, help="ucx_perftest's first port")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="nixl_link")
    p.add_argument("--role", choices=("target", "initiator"), help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "target":
        return run_target(Path(args.workdir), args.mib, args.block_kib)
    if args.role == "initiator":
        return run_initiator(Path(args.workdir), args.mib, args.block_kib, args.reps)
    exit_on_sigterm()
    result = run(args)
    report(result)
    json_path, png_path = save_results(args.name, result, plot(result))
    log(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
