"""Dev mode: a prefill engine and a decode engine as two local processes, the proxy in this one.

On CPU each engine gets its own core; on one GPU each gets a share of its memory. Start-up shows
progress; Ctrl-C or SIGTERM stops the proxy and then both engine process groups (a second one
while they stop is ignored: it would cut the cleanup short and leave them running).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from decode.role import CHUNK_TOKENS as DECODE_CHUNK_TOKENS
from launch.engine_guard import deployment_key
from launch.engine_hang import DEFAULT_TIMEOUT_S
from launch.engines import (
    EngineSpec,
    check_kv_capacity,
    default_dtype,
    default_ucx_tls,
    detect_device,
)
from launch.isolation import guard
from launch.observability.prometheus import require_binary as require_prometheus
from launch.observability.setup import ObservabilityOptions, Observer
from launch.processes import (
    EngineProcess,
    check_endpoints_free,
    check_port_plan,
    check_ports_free,
    reporting_shutdown,
    start_engine,
    stop_engines,
    wait_ready,
)
from launch.settings import EngineSettings, ProxySettings
from launch.shutdown import run_server
from launch.supervisor import Supervisor
from launch.testbed import LinkSpec, ThrottledLink
from proxy.config import ProxyConfig
from transport.kv_size import kv_bytes_per_token_for_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DevOptions:
    model_path: str
    served_model_name: str
    engine_base_port: int = 8100
    side_channel_base_port: int = 5600
    kv_events_base_port: int = 5700
    log_dir: Path = Path(".pdserve/logs")
    start_timeout_s: float = 600.0
    #: Put the prefill engine in its own network namespace behind a veth link throttled to this
    #: many Mbit/s (0 = a separate namespace, unthrottled); None = plain loopback.
    link_mbit: float | None = None
    #: Restart an engine that dies (see launch/supervisor.py).
    restart_engines: bool = True
    #: A ready engine whose /health goes unanswered this long is killed (and so restarted);
    #: 0: never (``launch/engine_hang.py``).
    hang_timeout_s: float = DEFAULT_TIMEOUT_S
    #: ``disaggregated``: a prefill and a decode engine. ``aggregated``: two engines that each
    #: serve whole requests. ``pool``: two engines that may do either (vLLM's ``kv_both``): the
    #: policy picks, per request, local on one or prefill on the other. Aggregated and pool
    #: are the same engines; ``POST /pd/admin/routing`` switches between them at run time.
    layout: str = "disaggregated"
    engines: EngineSettings = field(default_factory=EngineSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    observability: ObservabilityOptions = field(default_factory=ObservabilityOptions)


def engine_specs(opts: DevOptions, link: ThrottledLink | None = None,
                 api_key: str | None = None) -> tuple[EngineSpec, EngineSpec]:
    device = detect_device()
    base = EngineSpec(
        role="prefill",
        model=opts.model_path,
        served_model_name=opts.served_model_name,
        port=opts.engine_base_port,
        side_channel_port=opts.side_channel_base_port,
        device=device,
        kv_cache_gib=opts.engines.kv_cache_gib,
        dtype=default_dtype(device, opts.engines.dtype),
        max_model_len=opts.engines.max_model_len,
        connector=opts.engines.connector(cpu_fixes=device == "cpu"),
        extra_args=opts.engines.vllm_args(),
        kv_events_port=opts.kv_events_base_port,
        dev_endpoints=opts.engines.engine_dev_endpoints,
        api_key=api_key,
    )
    cores = (os.cpu_count() or 1) >= 2 and device == "cpu"
    prefill = replace(base, cpu_cores="0" if cores else None)
    decode = replace(
        base,
        role="decode",
        port=opts.engine_base_port + 1,
        side_channel_port=opts.side_channel_base_port + 1,
        kv_events_port=opts.kv_events_base_port + 1,
        cpu_cores="1" if cores else None,
    )
    if link is not None:  # prefill behind the throttled veth; KV crosses it
        tcp = default_ucx_tls(device, tcp_only=True)
        prefill = replace(prefill, host=link.ns_addr, netns=link.netns,
                          ucx_device=link.ns_device, ucx_tls=tcp)
        decode = replace(decode, ucx_device=link.host_device, ucx_tls=tcp)
    if opts.layout != "disaggregated":  # two engines alike: each may prefill or decode
        prefill, decode = replace(prefill, role="both"), replace(decode, role="both")
    return prefill, decode


def model_kv_bytes_per_token(model: str, dtype: str) -> int | None:
    """KV bytes per token of a local model dir (KV cache dtype = model dtype); None for hub ids."""
    if not os.path.isdir(model):
        return None
    return kv_bytes_per_token_for_model(model, dtype)


def check_kv_size_known(opts: DevOptions, kv_bytes_per_token: int | None) -> None:
    """``--policy auto`` weighs moving KV by its size: refuse a model whose size is unknown."""
    if kv_bytes_per_token is None and opts.proxy.policy == "auto":
        raise ValueError(
            f"--model {opts.model_path}: not a local model directory, so its KV bytes per "
            "token, which --policy auto weighs against the link, are unknown. Give a model "
            "directory (e.g. a downloaded snapshot), or --policy local / disaggregate / "
            "threshold:N")


def proxy_config(opts: DevOptions, prefill_spec: EngineSpec, decode_spec: EngineSpec,
                 kv_bytes_per_token: int | None, engine_key: str) -> ProxyConfig:
    """The proxy's config for these two engines (validated: its cross-field checks raise)."""
    pooled = opts.layout != "disaggregated"
    urls = (prefill_spec.url, decode_spec.url)
    events = (prefill_spec.kv_events_endpoint or "", decode_spec.kv_events_endpoint or "")
    return opts.proxy.config(
        prefill_urls=() if pooled else urls[:1],
        decode_urls=() if pooled else urls[1:],
        pool_urls=urls if pooled else (),
        pool_kv_events=events if pooled else (),
        layout="aggregated" if opts.layout == "aggregated" else "pool",
        served_model_names=(opts.served_model_name,),
        kv_bytes_per_token=kv_bytes_per_token,
        kv_lease_s=opts.engines.lease_s,
        prefill_kv_events=() if pooled else events[:1],
        decode_kv_events=() if pooled else events[1:],
        tokenizer=opts.model_path if os.path.isdir(opts.model_path) else None,
        max_model_len=opts.engines.max_model_len,
        decode_chunk_tokens=DECODE_CHUNK_TOKENS,
        engine_key=engine_key,
        otlp_traces_endpoint=opts.engines.otlp_traces_endpoint,
        # An engine whose core hung (proxy/stalls.py) is restarted by the supervisor.
        hung_restart_s=opts.hang_timeout_s if opts.restart_engines else 0.0,
    )


class Progress:
    """One status line on stderr: redrawn in place on a terminal, every 10 s otherwise."""

    def __init__(self) -> None:
        self._tty = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, elapsed: float, pending: list[EngineProcess]) -> None:
        if pending:
            names = ", ".join(e.spec.role for e in pending)
            msg = f"starting engines: {elapsed:5.0f}s, waiting for {names}"
        else:
            msg = f"engines ready after {elapsed:.0f}s"
        if self._tty:
            sys.stderr.write("\r\033[K" + msg + ("\n" if not pending else ""))
            sys.stderr.flush()
        elif not pending or elapsed - self._last >= 10:
            self._last = elapsed
            print(msg, file=sys.stderr, flush=True)


def run_dev(opts: DevOptions) -> int:
    """Run dev mode until interrupted; return the process exit code."""
    import uvicorn

    from proxy.app import create_app
    from proxy.server import uvicorn_config

    # SIGTERM (and SIGHUP: the terminal closed) must unwind like Ctrl-C so the engines are
    # stopped, never orphaned. (While the proxy serves, both stop it first: run_server.)
    signal.signal(signal.SIGTERM, lambda *_: _unwind(143))
    signal.signal(signal.SIGHUP, lambda *_: _unwind(129))
    ports = [
        ("proxy", opts.proxy.port),
        ("prefill engine", opts.engine_base_port),
        ("decode engine", opts.engine_base_port + 1),
        ("prefill NIXL side channel", opts.side_channel_base_port),
        ("decode NIXL side channel", opts.side_channel_base_port + 1),
        # (With --link-mbit the prefill engine's publisher binds in its namespace, where the
        # free-port check cannot look: a clash is refused here all the same.)
        ("prefill KV events", opts.kv_events_base_port),
        ("decode KV events", opts.kv_events_base_port + 1),
        *([("prometheus", opts.observability.prometheus_port)]
          if opts.observability.prometheus else []),
    ]
    check_port_plan(ports)
    check_ports_free(ports)
    log_dir = opts.log_dir
    engines: list[EngineProcess] = []
    link: ThrottledLink | None = None
    supervisor: Supervisor | None = None
    observer: Observer | None = None
    if opts.link_mbit is not None and opts.layout != "disaggregated":
        raise ValueError("--link-mbit puts the prefill engine behind the link: it needs "
                         "--layout disaggregated")
    # Everything a flag can get wrong is refused here, not after minutes of engine start-up.
    device = detect_device()
    kv_bytes_per_token = model_kv_bytes_per_token(opts.model_path,
                                                  default_dtype(device, opts.engines.dtype))
    check_kv_capacity(device, opts.engines.max_model_len, opts.engines.kv_blocks,
                      opts.engines.kv_cache_gib, kv_bytes_per_token)
    check_kv_size_known(opts, kv_bytes_per_token)
    key = deployment_key()
    proxy_config(opts, *engine_specs(opts, api_key=key), kv_bytes_per_token, key)
    if opts.observability.prometheus:
        require_prometheus()
    try:
        if opts.link_mbit is not None:
            link = ThrottledLink().create()
            link.set_rate(LinkSpec(rate_mbit=opts.link_mbit or None))
            print(f"throttled link: {link}", file=sys.stderr)
        prefill_spec, decode_spec = engine_specs(opts, link, api_key=key)
        check_endpoints_free([(f"{s.role} KV events", s.kv_events_endpoint or "")
                              for s in (prefill_spec, decode_spec)])
        for spec in (prefill_spec, decode_spec):
            engines.append(start_engine(spec, log_dir))
        _write_run_file(log_dir, opts, engines)
        print(f"engine logs: {log_dir}/", file=sys.stderr)
        wait_ready(engines, opts.start_timeout_s, Progress())
        confinement_report(engines)
        if opts.restart_engines:
            supervisor = Supervisor(engines, log_dir,
                                    on_restart=lambda es: _write_run_file(log_dir, opts, es),
                                    hang_timeout_s=opts.hang_timeout_s)
            supervisor.start()
        config = proxy_config(opts, prefill_spec, decode_spec, kv_bytes_per_token, key)
        url = f"http://{opts.proxy.host}:{opts.proxy.port}"
        pooled = opts.layout != "disaggregated"
        names = ("engine-0", "engine-1") if pooled else ("prefill-0", "decode-0")
        observer = Observer(opts.observability, url, [
            (name, spec.role, spec.url) for name, spec in zip(names, (prefill_spec, decode_spec))])
        auth = ' -H "Authorization: Bearer $PDSERVE_API_KEY"' if opts.proxy.api_key else ""
        print(
            f"\npdserve is serving {opts.served_model_name} at {url}/v1\n"
            f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f"    -d '{{\"model\": \"{opts.served_model_name}\", \"messages\": "
            f"[{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}]}}'\n",
            file=sys.stderr,
            flush=True,
        )
        app = create_app(config, restarter=supervisor)
        server = uvicorn.Server(uvicorn_config(app, config, opts.proxy.host, opts.proxy.port))
        return run_server(server)
    except KeyboardInterrupt:
        return 130
    finally:
        hold_stop_signals()
        with reporting_shutdown():
            run_each([
                ("supervisor", supervisor.stop if supervisor is not None else None),
                ("engines", lambda: stop_engines(engines)),
                ("prometheus", observer.stop if observer is not None else None),
                ("throttled link", link.destroy if link is not None else None),
            ])


def _unwind(code: int) -> None:
    hold_stop_signals()  # now: a second signal must not unwind the cleanup this one starts
    sys.exit(code)


def hold_stop_signals() -> None:
    """From here on a stop signal (a second Ctrl-C, the init system's SIGTERM after its own
    grace, SIGHUP) is ignored: raised inside the cleanup, it would unwind past
    ``stop_engines`` and leave the engines running. The cleanup is bounded (each engine's
    grace, then SIGKILL). A Python handler, not ``SIG_IGN``: that would be inherited by what
    the cleanup starts (``ip`` for the throttled link)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)


def run_each(steps: Sequence[tuple[str, Callable[[], object] | None]]) -> None:
    """Run every cleanup step in order, whatever the ones before it raised (logged)."""
    for name, step in steps:
        if step is None:
            continue
        try:
            step()
        except Exception:
            log.exception("stopping the %s failed", name)


def confinement_report(engines: Sequence[EngineProcess]) -> None:
    """Say on which cores each engine runs, after checking that all of it is there."""
    for e in engines:
        if e.spec.cpu_cores:
            print(f"{e.spec.role} engine: every process and thread on core {e.spec.cpu_cores}",
                  file=sys.stderr)
    guard(((e.name, e.popen.pid, e.spec.cpu_cores) for e in engines),
          lambda msg: print(f"warning: {msg}", file=sys.stderr))


def _write_run_file(log_dir: Path, opts: DevOptions, engines: Sequence[EngineProcess]) -> None:
    """``run.json``: what this dev mode started (pids, urls), for operators and tests."""
    info = {
        "proxy": f"http://{opts.proxy.host}:{opts.proxy.port}",
        "parent_pid": os.getpid(),
        "engines": [
            {"role": e.spec.role, "url": e.spec.url, "pid": e.popen.pid,
             "side_channel_port": e.spec.side_channel_port, "log": str(e.log_path),
             "cpu_cores": e.spec.cpu_cores}
            for e in engines
        ],
    }
    # Whole or not at all, for whoever reads it meanwhile (rewritten on every restart).
    fd, tmp = tempfile.mkstemp(dir=log_dir, prefix=".run.json.")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(info, indent=2))
    os.replace(tmp, log_dir / "run.json")
