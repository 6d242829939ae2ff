"""``pdserve`` command line: the only place that reads argv and environment variables."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from launch.processes import EngineFailed, PortBusy


def _add_tier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--offload-gib", type=float, default=0.0,
                   help="host-memory KV offload tier per engine, GiB (0 = none): evicted "
                        "prefixes come back from it instead of being recomputed")
    p.add_argument("--offload-eviction", choices=("lru", "arc"), default="lru",
                   help="which chunk a full offload tier drops")
    p.add_argument("--offload-store-threshold", type=int, default=0,
                   help="store a block in the tier only once it was offered this many times")
    p.add_argument("--offload-fs-dir", default=None,
                   help="GPU only: a file-system KV tier under the host tier, in this directory")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="cap each engine's KV cache at this many blocks (tests, benchmarks)")


def _add_slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="time-to-first-token target: with a target set, the auto policy "
                        "also weighs the streams decoding on an engine (a request's own "
                        "'slo' overrides)")
    p.add_argument("--slo-itl-ms", type=float, default=None,
                   help="target for the longest gap between two tokens of a stream")


def _tier_options(args: argparse.Namespace) -> dict:
    return dict(offload_gib=args.offload_gib, offload_eviction=args.offload_eviction,
                offload_store_threshold=args.offload_store_threshold, kv_blocks=args.kv_blocks,
                offload_fs_dir=args.offload_fs_dir)


def _add_dev(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dev", help="prefill + decode engines on this machine, proxy in front")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (default, embedded), 'tiny' (test model), a local HF model "
                        "directory, or a hub id where the hub is reachable")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--engine-base-port", type=int, default=8100,
                   help="prefill engine on this port, decode on the next")
    p.add_argument("--side-channel-base-port", type=int, default=5600)
    p.add_argument("--policy", default="auto",
                   help="auto (live cost model) | disaggregate | local | threshold:N")
    _add_slo_args(p)
    p.add_argument("--layout", choices=("disaggregated", "aggregated", "pool"),
                   default="disaggregated",
                   help="disaggregated: a prefill + a decode engine; aggregated: two engines "
                        "that each serve whole requests; pool: two engines that may do either "
                        "(the policy picks per request)")
    p.add_argument("--probe-tokens", default="64,256,1024",
                   help="prompt lengths of the start-up probes that seed the cost model "
                        "('' for none)")
    p.add_argument("--kv-cache-gib", type=int, default=2,
                   help="CPU: KV cache per engine, whole GiB (vLLM's VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--kv-events-base-port", type=int, default=5700)
    p.add_argument("--reprobe-s", type=float, default=30.0,
                   help="re-measure a prefill->decode link after this long without a "
                        "hand-over (0 = never)")
    p.add_argument("--prefill-deadline-s", type=float, default=120.0,
                   help="give up on a prefill after this long and serve the request locally")
    p.add_argument("--first-byte-deadline-s", type=float, default=120.0,
                   help="504 when decode has not started answering after this long")
    p.add_argument("--idle-deadline-s", type=float, default=60.0,
                   help="end a stream with an in-band error when decode sends nothing this long")
    p.add_argument("--max-inflight", type=int, default=256,
                   help="requests served at once (admission control)")
    p.add_argument("--max-queued", type=int, default=256,
                   help="requests that may wait for a slot; beyond: 503 + Retry-After")
    p.add_argument("--engine-dev-endpoints", action="store_true",
                   help="expose vLLM's dev endpoints on the engines (testbeds/benchmarks)")
    p.add_argument("--link-mbit", type=float, default=None,
                   help="testbed: prefill engine in its own network namespace behind a veth "
                        "link throttled to this rate (0 = unthrottled); needs root")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--lease-s", type=int, default=30)
    p.add_argument("--no-restart", action="store_true",
                   help="leave an engine that dies down (default: restart it, with backoff)")
    _add_tier_args(p)
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require this bearer token on /v1/* (default: $PDSERVE_API_KEY)")
    p.add_argument("--private-ops", action="store_true",
                   help="/health, /metrics and /pd/* need the API key too (default: public)")
    p.add_argument("--log-dir", type=Path, default=Path(".pdserve/logs"))
    p.add_argument("--start-timeout-s", type=float, default=600.0)


def _add_ray(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ray", help="engines as Ray actors on a cluster, proxy in front")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join ('auto' on a ray-up head); default: start a local one")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' / 'tiny' (built on every node) or a model directory present "
                        "on every node")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--prefill", type=int, default=1, help="prefill engines")
    p.add_argument("--decode", type=int, default=1, help="decode engines")
    p.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto",
                   help="one GPU per engine, or one CPU (auto: GPU if the cluster has any)")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="logical CPUs of a local cluster (default: Ray's count)")
    p.add_argument("--namespace", default="pdserve",
                   help="Ray namespace of this deployment's engine actors")
    p.add_argument("--max-restarts", type=int, default=-1,
                   help="restarts of a dead engine's actor (-1: always)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", default="auto")
    _add_slo_args(p)
    p.add_argument("--probe-tokens", default="64,256,1024")
    p.add_argument("--reprobe-s", type=float, default=30.0)
    p.add_argument("--kv-cache-gib", type=int, default=2,
                   help="CPU: KV cache per engine, whole GiB (vLLM's VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--lease-s", type=int, default=30)
    _add_tier_args(p)
    p.add_argument("--engine-dev-endpoints", action="store_true")
    p.add_argument("--prefill-deadline-s", type=float, default=120.0)
    p.add_argument("--first-byte-deadline-s", type=float, default=120.0)
    p.add_argument("--max-inflight", type=int, default=256)
    p.add_argument("--max-queued", type=int, default=256)
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    p.add_argument("--private-ops", action="store_true",
                   help="/health, /metrics and /pd/* need the API key too (default: public)")
    p.add_argument("--log-dir", default="/tmp/pdserve-ray-logs",
                   help="engine logs, on each engine's node")
    p.add_argument("--start-timeout-s", type=float, default=900.0)


def _run_ray(args: argparse.Namespace) -> int:
    from launch.models import ensure_model
    from launch.ray_engine import EngineTemplate
    from launch.ray_mode import RayOptions, run_ray

    if args.prefill < 0 or args.decode < 1:
        raise ValueError("need --decode >= 1 and --prefill >= 0")
    path = ensure_model(args.model, progress=lambda m: print(m, file=sys.stderr, flush=True))
    template = EngineTemplate(
        model=args.model if args.model in ("tiny", "smollm2") else str(path),
        served_model_name=args.served_model_name or _model_name(args.model),
        kv_cache_gib=args.kv_cache_gib, max_model_len=args.max_model_len, lease_s=args.lease_s,
        dev_endpoints=args.engine_dev_endpoints, log_dir=args.log_dir, **_tier_options(args),
    )
    return run_ray(RayOptions(
        template=template, model_path=str(path), prefill=args.prefill, decode=args.decode,
        address=args.address, namespace=args.namespace, local_num_cpus=args.num_cpus,
        accelerator=args.accelerator, max_restarts=args.max_restarts, host=args.host,
        port=args.port, policy=args.policy,
        probe_tokens=tuple(int(x) for x in args.probe_tokens.split(",") if x.strip()),
        reprobe_s=args.reprobe_s, api_key=args.api_key, public_ops=not args.private_ops,
        start_timeout_s=args.start_timeout_s,
        prefill_deadline_s=args.prefill_deadline_s,
        first_byte_deadline_s=args.first_byte_deadline_s, max_inflight=args.max_inflight,
        max_queued=args.max_queued, slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms,
    ))


def _add_scale(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", help="grow or shrink a running Ray-mode deployment")
    p.add_argument("role", choices=("prefill", "decode"))
    p.add_argument("replicas", type=int)
    p.add_argument("--proxy", default="http://127.0.0.1:8000", help="the proxy's base url")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    p.add_argument("--private-ops", action="store_true",
                   help="/health, /metrics and /pd/* need the API key too (default: public)")
    p.add_argument("--timeout-s", type=float, default=900.0)


def _run_scale(args: argparse.Namespace) -> int:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        args.proxy.rstrip("/") + "/pd/admin/scale", method="POST",
        data=json.dumps({"role": args.role, "replicas": args.replicas}).encode(),
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})})
    try:
        with urllib.request.urlopen(req, timeout=args.timeout_s) as r:
            print(r.read().decode())
            return 0
    except urllib.error.HTTPError as e:
        print(f"pdserve: error: {e.code}: {e.read().decode(errors='replace')}", file=sys.stderr)
    except OSError as e:
        print(f"pdserve: error: cannot reach {args.proxy}: {e}", file=sys.stderr)
    return 2


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="breakeven link bandwidth and crossover prompt length for a model",
        description="Is moving KV worth it on this link? Prints the breakeven bandwidth and the "
                    "cached-prompt length from which moving KV beats recomputing it.")
    p.add_argument("--model", required=True,
                   help="a config.json, a HF model directory, or 'smollm2' / 'tiny'")
    p.add_argument("--prefill-rate", type=float, required=True,
                   help="prefill throughput of one engine, tokens/s")
    p.add_argument("--link", action="append", default=None,
                   help="a preset (nvlink, pcie5, pcie4, rdma400, rdma200, eth100, eth25, "
                        "eth10) or Gb/s; repeatable (default: every preset)")
    p.add_argument("--fixed-ms", type=float, default=None,
                   help="per-transfer fixed cost (default: the preset's, 1 ms for a number)")
    p.add_argument("--kv-dtype", default="bfloat16")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (KV heads split)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _run_plan(args: argparse.Namespace) -> int:
    import json

    from launch.plan import PRESETS, load_config, plan, render, resolve_link

    links = [resolve_link(x, args.fixed_ms) for x in (args.link or list(PRESETS))]
    plans = plan(load_config(args.model), args.kv_dtype, args.tp, args.prefill_rate, links)
    print(json.dumps([p.as_dict() for p in plans], indent=2) if args.json else render(plans))
    return 0


def _model_name(model: str) -> str:
    return {"smollm2": "SmolLM2-135M-Instruct", "tiny": "pdserve-tiny"}.get(
        model, Path(model).name if os.path.isdir(model) else model
    )


def _run_dev(args: argparse.Namespace) -> int:
    from launch.dev import DevOptions, run_dev
    from launch.models import ensure_model

    path = ensure_model(args.model, progress=lambda m: print(m, file=sys.stderr, flush=True))
    opts = DevOptions(
        model_path=str(path),
        served_model_name=args.served_model_name or _model_name(args.model),
        port=args.port,
        host=args.host,
        engine_base_port=args.engine_base_port,
        side_channel_base_port=args.side_channel_base_port,
        policy=args.policy,
        probe_tokens=tuple(int(x) for x in args.probe_tokens.split(",") if x.strip()),
        kv_cache_gib=args.kv_cache_gib,
        max_model_len=args.max_model_len,
        api_key=args.api_key,
        public_ops=not args.private_ops,
        log_dir=args.log_dir,
        start_timeout_s=args.start_timeout_s,
        lease_s=args.lease_s,
        **_tier_options(args),
        kv_events_base_port=args.kv_events_base_port,
        link_mbit=args.link_mbit,
        reprobe_s=args.reprobe_s,
        prefill_deadline_s=args.prefill_deadline_s,
        first_byte_deadline_s=args.first_byte_deadline_s,
        idle_deadline_s=args.idle_deadline_s,
        max_inflight=args.max_inflight,
        max_queued=args.max_queued,
        engine_dev_endpoints=args.engine_dev_endpoints,
        restart_engines=not args.no_restart,
        layout=args.layout,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms,
    )
    return run_dev(opts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_dev(sub)
    _add_ray(sub)
    _add_scale(sub)
    _add_plan(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "dev":
            return _run_dev(args)
        if args.command == "ray":
            return _run_ray(args)
        if args.command == "scale":
            return _run_scale(args)
        if args.command == "plan":
            return _run_plan(args)
    except (PortBusy, EngineFailed, ValueError, RuntimeError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
