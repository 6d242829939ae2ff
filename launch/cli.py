"""``pdserve`` command line: the only place that reads argv and environment variables."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from launch.engine_hang import DEFAULT_TIMEOUT_S as HANG_TIMEOUT_S
from launch.processes import EngineFailed, PortBusy


def _add_dev(sub: argparse._SubParsersAction) -> None:
    from launch.dev import DevOptions

    p = sub.add_parser("dev", help="prefill + decode engines on this machine, proxy in front")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (default, embedded), 'tiny' (test model), a local HF model "
                        "directory, or a hub id where the hub is reachable")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--layout", choices=("disaggregated", "aggregated", "pool"),
                   default=DevOptions.layout,
                   help="disaggregated: a prefill + a decode engine; aggregated: two engines "
                        "that each serve whole requests; pool: two engines that may do either "
                        "(the policy picks per request)")
    p.add_argument("--engine-base-port", type=int, default=DevOptions.engine_base_port,
                   help="prefill engine on this port, decode on the next")
    p.add_argument("--side-channel-base-port", type=int,
                   default=DevOptions.side_channel_base_port)
    p.add_argument("--kv-events-base-port", type=int, default=DevOptions.kv_events_base_port)
    p.add_argument("--link-mbit", type=float, default=DevOptions.link_mbit,
                   help="testbed: prefill engine in its own network namespace behind a veth "
                        "link throttled to this rate (0 = unthrottled); needs root")
    p.add_argument("--no-restart", action="store_true",
                   help="leave an engine that dies down (default: restart it, with backoff)")
    _add_hang_timeout(p, "restarted (--no-restart: not watched)")
    p.add_argument("--log-dir", type=Path, default=DevOptions.log_dir)
    p.add_argument("--start-timeout-s", type=float, default=DevOptions.start_timeout_s)
    _add_observability(p)
    _add_settings(p)


def _add_hang_timeout(p: argparse.ArgumentParser, then: str) -> None:
    p.add_argument("--hang-timeout-s", type=float, default=HANG_TIMEOUT_S,
                   help="a ready engine whose /health goes unanswered this long (alive but "
                        f"hung) is killed, and {then} (0: never)")


def _check_hang_timeout(args: argparse.Namespace) -> None:
    if args.hang_timeout_s < 0:
        raise ValueError("need --hang-timeout-s >= 0 (0: never)")


def _add_ray(sub: argparse._SubParsersAction) -> None:
    from launch.ray_engine import EngineTemplate
    from launch.ray_mode import RayOptions

    p = sub.add_parser("ray", help="engines as Ray actors on a cluster, proxy in front")
    p.add_argument("--address", default=RayOptions.address,
                   help="Ray cluster to join ('auto' on a ray-up head); default: start a local one")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' / 'tiny' (built on every node), a model directory present "
                        "on every node, or a hub id (each engine's node downloads it)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--prefill", type=int, default=RayOptions.prefill, help="prefill engines")
    p.add_argument("--decode", type=int, default=RayOptions.decode, help="decode engines")
    p.add_argument("--accelerator", choices=("auto", "cpu", "gpu"),
                   default=RayOptions.accelerator,
                   help="one GPU per engine, or one CPU (auto: GPU if the cluster has any)")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-on", metavar="RESOURCE[,RESOURCE...]", default=None, help=(
            f"{role} engines only on the nodes that offer this Ray custom resource (give it "
            f"per node: ray start --resources='{{\"RESOURCE\": 100}}', e.g. in the cluster "
            f"file's start commands); a list: round robin, each new {role} engine on the "
            f"one its role's engines use least (one {role} engine per node, say); a local "
            "cluster offers them all"))
    p.add_argument("--num-cpus", type=int, default=RayOptions.local_num_cpus,
                   help="logical CPUs of a local cluster (default: Ray's count)")
    p.add_argument("--namespace", default=RayOptions.namespace,
                   help="Ray namespace of this deployment's engine actors")
    p.add_argument("--max-restarts", type=int, default=RayOptions.max_restarts,
                   help="restarts of a dead engine's actor (-1: always)")
    p.add_argument("--log-dir", default=EngineTemplate.log_dir,
                   help="engine logs, on each engine's node (default: /tmp/pdserve-<uid>/logs)")
    _add_hang_timeout(p, "Ray restarts its actor")
    p.add_argument("--start-timeout-s", type=float, default=RayOptions.start_timeout_s,
                   help="how long the engines may take to become ready, at start-up and "
                        "after: one starting longer (stuck loading, or waiting for a node "
                        "that is gone) is stopped and replaced")
    _add_observability(p)
    _add_settings(p)


def _add_observability(p: argparse.ArgumentParser) -> None:
    from launch.observability.setup import ObservabilityOptions as O

    g = p.add_argument_group("observability")
    g.add_argument("--observability", action="store_true",
                   help="also run a Prometheus (the `prometheus` binary) scraping the proxy and "
                        "every engine; the targets file is kept current either way")
    g.add_argument("--prometheus-port", type=int, default=O.prometheus_port)
    g.add_argument("--scrape-interval-s", type=float, default=O.scrape_interval_s)
    g.add_argument("--observability-dir", type=Path, default=None,
                   help="targets file, Prometheus config and data (default: "
                        f"<log-dir>/observability in dev mode, {O.workdir} in Ray mode)")


def _observability(args: argparse.Namespace, default_dir: Path):
    from launch.observability.setup import ObservabilityOptions

    return ObservabilityOptions(prometheus=args.observability,
                                prometheus_port=args.prometheus_port,
                                scrape_interval_s=args.scrape_interval_s,
                                workdir=args.observability_dir or default_dir)


def _add_settings(p: argparse.ArgumentParser) -> None:
    """The flags both modes share, generated from ``launch/settings.py``."""
    from launch.settings import EngineSettings, ProxySettings, add_arguments

    add_arguments(p.add_argument_group("engines"), EngineSettings)
    add_arguments(p.add_argument_group("proxy"), ProxySettings)


def _settings(args: argparse.Namespace):
    from launch.settings import EngineSettings, ProxySettings, from_args

    proxy = from_args(ProxySettings, args)
    if proxy.api_key is None and os.environ.get("PDSERVE_API_KEY"):
        proxy = proxy.model_copy(update={"api_key": os.environ["PDSERVE_API_KEY"]})
    return from_args(EngineSettings, args), proxy


def _run_ray(args: argparse.Namespace) -> int:
    from launch.models import ensure_model
    from launch.observability.setup import ObservabilityOptions
    from launch.ray_engine import EngineTemplate
    from launch.ray_mode import RayOptions, run_ray

    if args.prefill < 0 or args.decode < 1:
        raise ValueError("need --decode >= 1 and --prefill >= 0")
    _check_hang_timeout(args)
    engines, proxy = _settings(args)
    path = ensure_model(args.model, progress=lambda m: print(m, file=sys.stderr, flush=True))
    template = EngineTemplate(
        model=args.model if args.model in ("tiny", "smollm2") else str(path),
        served_model_name=args.served_model_name or _model_name(args.model),
        log_dir=args.log_dir, engines=engines, hang_timeout_s=args.hang_timeout_s,
    )
    return run_ray(RayOptions(
        template=template, model_path=str(path), prefill=args.prefill, decode=args.decode,
        address=args.address, namespace=args.namespace, local_num_cpus=args.num_cpus,
        accelerator=args.accelerator, max_restarts=args.max_restarts,
        placement={role: tuple(r for r in resources.split(",") if r) for role, resources in
                   (("prefill", args.prefill_on), ("decode", args.decode_on)) if resources},
        start_timeout_s=args.start_timeout_s, proxy=proxy,
        observability=_observability(args, ObservabilityOptions.workdir),
    ))


def _add_scale(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", help="grow or shrink a running Ray-mode deployment")
    p.add_argument("role", choices=("prefill", "decode"))
    p.add_argument("replicas", type=int)
    p.add_argument("--proxy", default="http://127.0.0.1:8000", help="the proxy's base url")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    p.add_argument("--private-ops", action="store_true",
                   help="/health, /metrics and /pd/* need the API key too (default: public)")
    p.add_argument("--drain-timeout-s", type=float, default=None,
                   help="how long engines being removed may finish what they serve; past it "
                        "they go anyway and their streams continue on the others (default: "
                        "the deployment's --total-deadline-s)")
    p.add_argument("--timeout-s", type=float, default=900.0)


def _run_scale(args: argparse.Namespace) -> int:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        args.proxy.rstrip("/") + "/pd/admin/scale", method="POST",
        data=json.dumps({"role": args.role, "replicas": args.replicas, **(
            {"drain_timeout_s": args.drain_timeout_s} if args.drain_timeout_s is not None
            else {})}).encode(),  # 0 is sent as asked: the proxy answers it (400), not drops it
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


def _add_node_watch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "node-watch", help="on a Ray worker node: stop its Ray once the head's Ray is gone",
        description="Runs `ray stop` on this node when the head's GCS refuses connections "
                    "three times in a row (2 s apart): `ray down` with the on-premises "
                    "provider stops the head only. An unreachable head is left to Ray's own "
                    "reconnect timeout. Exits when this node's raylet is gone.")
    p.add_argument("--address", required=True, help="the head's GCS, host:port")


def _run_node_watch(args: argparse.Namespace) -> int:
    from launch.node_watch import watch

    watch(args.address)
    return 0


def _model_name(model: str) -> str:
    return {"smollm2": "SmolLM2-135M-Instruct", "tiny": "pdserve-tiny"}.get(
        model, Path(model).name if os.path.isdir(model) else model
    )


def _run_dev(args: argparse.Namespace) -> int:
    from launch.dev import DevOptions, run_dev
    from launch.models import ensure_model

    _check_hang_timeout(args)
    engines, proxy = _settings(args)
    path = ensure_model(args.model, progress=lambda m: print(m, file=sys.stderr, flush=True))
    return run_dev(DevOptions(
        model_path=str(path),
        served_model_name=args.served_model_name or _model_name(args.model),
        engine_base_port=args.engine_base_port,
        side_channel_base_port=args.side_channel_base_port,
        kv_events_base_port=args.kv_events_base_port,
        log_dir=args.log_dir,
        start_timeout_s=args.start_timeout_s,
        link_mbit=args.link_mbit,
        restart_engines=not args.no_restart,
        hang_timeout_s=args.hang_timeout_s,
        layout=args.layout,
        engines=engines,
        proxy=proxy,
        observability=_observability(args, args.log_dir / "observability"),
    ))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_dev(sub)
    _add_ray(sub)
    _add_scale(sub)
    _add_plan(sub)
    _add_node_watch(sub)
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
        if args.command == "node-watch":
            return _run_node_watch(args)
    except (PortBusy, EngineFailed, ValueError, RuntimeError, OSError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
