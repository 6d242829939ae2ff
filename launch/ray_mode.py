"""Ray mode: prefill and decode engines as Ray actors across a cluster, the proxy in front.

``pdserve ray`` connects to a running cluster (``--address auto`` on a ``ray up`` head) or starts
a local one, places N prefill and M decode :class:`~launch.ray_engine.EngineHost` actors with
explicit resource requests (one GPU each on GPU clusters, one CPU here; with ``--prefill-on`` /
``--decode-on``, only on the nodes that offer the named Ray custom resource), waits for their
engines, then serves the proxy in this process. The proxy finds engines through Ray
(:class:`RayDirectory` lists the named actors of the deployment's namespace) and scales them
through :class:`RayScaler` (``POST /pd/admin/scale``, or ``pdserve scale``); both in
``launch/ray_actors.py``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from decode.role import CHUNK_TOKENS as DECODE_CHUNK_TOKENS
from launch.engine_guard import deployment_key
from launch.isolation import parse_cores, sharing
from launch.observability.setup import ObservabilityOptions, Observer
from launch.observability.targets import ObservedDirectory
from launch.processes import reporting_shutdown
from launch.ray_actors import (
    RayDirectory,
    RayScaler,
    ordinal,
    resolve_accelerator,
    unplaceable,
)
from launch.ray_engine import EngineTemplate, wait_engines_ready
from launch.replica_plan import ReplicaRule
from launch.settings import EngineSettings, ProxySettings
from launch.shutdown import run_server
from proxy.policy_mode import parse_policy

log = logging.getLogger(__name__)

#: What a local cluster (one node, this machine) offers of each placement resource named.
LOCAL_PLACEMENT = 100.0


def report_core_sharing(infos: list[dict[str, Any]]) -> None:
    """Each engine's tree is confined to its cores; when engines outnumber a node's cores some
    share one: say which, at start-up (their streams then wait on each other)."""
    by_node: dict[str, dict[str, frozenset[int]]] = {}
    for i in infos:
        if i.get("cpu_cores"):
            by_node.setdefault(i["node_ip"], {})[i["name"]] = parse_cores(i["cpu_cores"])
    for node, assignments in sorted(by_node.items()):
        for core, names in sharing(assignments).items():
            print(f"warning: node {node}: {', '.join(sorted(names))} share core {core} "
                  "(more engines than cores)", file=sys.stderr, flush=True)


def deployment_kv_bytes_per_token(infos: list[dict[str, Any]], policy: str, model: str
                                  ) -> int | None:
    """The KV bytes per token the ready engines found in the model's config (a hub id's is in
    the Hugging Face cache of each engine's node once it loaded it). None when none found
    one; RuntimeError then if the policy needs it, saying what to do instead."""
    kvb = next((i["kv_bytes_per_token"] for i in infos if i["kv_bytes_per_token"]), None)
    if kvb is None and parse_policy(policy).kind == "auto":
        raise RuntimeError(
            f"policy 'auto' needs the KV size of {model}, and no engine could read it from "
            "its config.json (a model directory's, or a hub id's in its node's Hugging Face "
            "cache): "
            "give a model directory present on every node, or a fixed --policy "
            "(disaggregate, local, threshold:N)")
    return kvb


@dataclass(frozen=True)
class RayOptions:
    template: EngineTemplate
    model_path: str  # the model on this (the proxy's) node: tokenizer and KV sizing
    prefill: int = 1
    decode: int = 1
    address: str | None = None  # None: start a local cluster
    namespace: str = "pdserve"
    local_num_cpus: int | None = None
    accelerator: str = "auto"  # auto | cpu | gpu
    #: Role -> Ray custom resources: that role's engines only on nodes that offer them, round
    #: robin (``decode-0`` on one node's, ``decode-1`` on another's; a new engine on the one
    #: its role uses least).
    placement: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    max_restarts: int = -1
    start_timeout_s: float = 900.0
    proxy: ProxySettings = field(default_factory=ProxySettings)
    observability: ObservabilityOptions = field(default_factory=ObservabilityOptions)


def otel_runtime_env(environ: Mapping[str, str], engines: EngineSettings
                     ) -> dict[str, Any] | None:
    """The launcher's ``OTEL_*`` settings (the exporter's protocol, batching) for every actor
    and so every engine: vLLM reads them from its environment, and an actor's is its node's,
    not the launcher's. None when tracing is off or nothing is set."""
    otel = {k: v for k, v in environ.items() if k.startswith("OTEL_")}
    if not engines.otlp_traces_endpoint or not otel:
        return None
    return {"env_vars": otel}


def _progress(elapsed: float, pending: list[str]) -> None:
    if pending:
        print(f"starting engines: {elapsed:5.0f}s, waiting for {', '.join(pending)}",
              file=sys.stderr, flush=True)
    else:
        print(f"engines ready after {elapsed:.0f}s", file=sys.stderr, flush=True)


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); an IPv6 host comes bracketed (``[::1]:6379``, as Ray
    writes it) and is returned bare, as sockets take it."""
    host, _, port = address.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def exit_when_ray_is_gone(gcs_address: str, gone: threading.Event, interval_s: float = 2.0,
                          misses: int = 3, grace_s: float = 10.0) -> None:
    """Watch the cluster's GCS port; when it stops answering (``ray down``, ``ray stop``, head
    lost) set ``gone`` and SIGTERM this process, so the proxy never outlives its cluster. A
    shutdown still running ``grace_s`` later is stuck in a Ray call that waits for the lost GCS
    (the engine directory's, in a worker thread the event loop waits for at exit; Ray's own
    core worker aborts the process only after 60 s): the process then exits at once. Its
    engines went with the cluster's workers (each dies with its actor)."""
    host, port = split_address(gcs_address)

    def watch() -> None:
        missed = 0
        while True:
            time.sleep(interval_s)
            try:
                socket.create_connection((host, port), timeout=2).close()
                missed = 0
            except OSError:
                missed += 1
                if missed >= misses:
                    print("pdserve: the Ray cluster is gone; stopping", file=sys.stderr,
                          flush=True)
                    gone.set()
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(grace_s)
                    print("pdserve: shutdown is stuck on the lost cluster; exiting",
                          file=sys.stderr, flush=True)
                    os._exit(143)

    threading.Thread(target=watch, name="ray-watchdog", daemon=True).start()


def ray_init_kwargs(opts: RayOptions, environ: Mapping[str, str]) -> dict[str, Any]:
    """``ray.init``'s arguments. Without ``--address`` a cluster of our own on this machine
    ("local"): ``None`` would join whatever RAY_ADDRESS or the last ``ray start`` here names."""
    local = opts.address is None
    return dict(
        address="local" if local else opts.address, namespace=opts.namespace,
        include_dashboard=False, num_cpus=opts.local_num_cpus if local else None,
        # One node, this machine: it offers every placement resource named.
        resources={r: LOCAL_PLACEMENT for rs in opts.placement.values() for r in rs}
        if local else None,
        log_to_driver=False, configure_logging=False,
        runtime_env=otel_runtime_env(environ, opts.template.engines))


def run_ray(opts: RayOptions) -> int:
    """Run Ray mode until interrupted; return the process exit code."""
    import ray
    import uvicorn

    from proxy.app import create_app
    from proxy.server import uvicorn_config

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"connecting to Ray ({opts.address or 'starting a local cluster'}) ...",
          file=sys.stderr, flush=True)
    ray.init(**ray_init_kwargs(opts, os.environ))
    ray_gone = threading.Event()
    exit_when_ray_is_gone(ray.get_runtime_context().gcs_address, ray_gone)
    accelerator = resolve_accelerator(opts.accelerator, ray.cluster_resources())
    for role, resource in unplaceable(opts.placement, ray.cluster_resources()):
        print(f"warning: no node offers the Ray resource {resource!r} yet: the {role} engines "
              f"wait for one (a node offers it with ray start --resources="
              f"'{{\"{resource}\": 100}}')", file=sys.stderr, flush=True)
    key = deployment_key()
    template = replace(opts.template, api_key=key,
                       bind_host=opts.template.bind_host or ("127.0.0.1" if opts.address is None
                                                             else None))
    scaler = RayScaler(opts.namespace, template, accelerator, opts.max_restarts,
                       opts.placement, ReplicaRule(ready_within_s=opts.start_timeout_s))
    observer: Observer | None = None
    try:
        scaler.create("prefill", opts.prefill)
        scaler.create("decode", opts.decode)
        last = [0.0]

        def progress(elapsed: float, pending: list[str]) -> None:
            if not pending or elapsed - last[0] >= 10:
                last[0] = elapsed
                _progress(elapsed, pending)

        infos = wait_engines_ready(scaler.handles, opts.start_timeout_s, progress)
        report_core_sharing(infos)
        kvb = deployment_kv_bytes_per_token(infos, opts.proxy.policy, opts.template.model)
        # Ordinal order: the proxy names configured engines <role>-<index>, like the actors.
        by_role = {r: sorted((i for i in infos if i["role"] == r),
                             key=lambda i: ordinal(i["name"]))
                   for r in ("prefill", "decode")}
        config = opts.proxy.config(
            prefill_urls=tuple(i["url"] for i in by_role["prefill"]),
            decode_urls=tuple(i["url"] for i in by_role["decode"]),
            prefill_kv_events=tuple(i["kv_events"] or "" for i in by_role["prefill"]),
            decode_kv_events=tuple(i["kv_events"] or "" for i in by_role["decode"]),
            served_model_names=(opts.template.served_model_name,),
            kv_bytes_per_token=kvb,
            kv_lease_s=opts.template.engines.lease_s,
            tokenizer=opts.model_path if Path(opts.model_path).is_dir() else None,
            max_model_len=opts.template.engines.max_model_len,
            decode_chunk_tokens=DECODE_CHUNK_TOKENS,
            engine_key=key,
            otlp_traces_endpoint=opts.template.engines.otlp_traces_endpoint,
            # An engine whose core hung (proxy/stalls.py) has its actor killed: Ray restarts it.
            hung_restart_s=opts.template.hang_timeout_s,
        )
        url = f"http://{opts.proxy.host}:{opts.proxy.port}"
        print(f"\npdserve (ray, {accelerator}: {opts.prefill} prefill x {opts.decode} decode) "
              f"is serving {opts.template.served_model_name} at {url}/v1\n", file=sys.stderr,
              flush=True)
        observer = Observer(opts.observability, url, [
            (i["name"], i["role"], i["url"]) for i in infos])
        directory = ObservedDirectory(RayDirectory(opts.namespace), observer.targets)
        app = create_app(config, directory=directory, scaler=scaler, restarter=scaler)
        server = uvicorn.Server(uvicorn_config(app, config, opts.proxy.host, opts.proxy.port))
        return run_server(server)
    except KeyboardInterrupt:
        return 130
    finally:
        with reporting_shutdown():
            if observer is not None:
                observer.stop()
            if not ray_gone.is_set():  # else the engines went with the cluster's workers
                scaler.stop_all()
                ray.shutdown()
        if ray_gone.is_set():
            # Nothing is left to clean up, and what remains of a normal exit waits for the
            # lost cluster: the interpreter joins the engine directory's call threads, one
            # stuck on the lost GCS, and runs Ray's own exit hook (seen before: the watchdog's
            # 10 s grace ran out every time). Leave now.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(143)
