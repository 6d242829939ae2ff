"""A deployment's settings, written once: each field's type, default and help live here, and
``pdserve dev`` / ``pdserve ray`` flags are generated from them (``add_arguments``), validated
once at the edge (``from_args``), and handed down whole.

Two groups, because they go to different places:

- :class:`EngineSettings`: how every engine is started (dev mode's processes and Ray mode's
  actors alike): KV cache size, context length, the KV lease, the offload tier.
- :class:`ProxySettings`: the proxy's operator knobs: policy, latency targets, probes,
  deadlines, admission, auth. Their defaults are :class:`proxy.config.ProxyConfig`'s (the
  proxy owns what it does when nobody says otherwise); :meth:`ProxySettings.config` builds
  that config with what the launcher wired (engine urls, KV sizing, tokenizer).

What only one mode has (dev's ports and layout, Ray's replica counts and address) stays with
that mode's flags in ``launch/cli.py``.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from proxy.config import ProxyConfig
from proxy.policy import parse_policy
from transport.connector import ConnectorOptions

_FROZEN = ConfigDict(extra="forbid", frozen=True)


def _proxy_default(name: str) -> Any:
    return ProxyConfig.model_fields[name].default


class EngineSettings(BaseModel):
    """How every engine of a deployment is started."""

    model_config = _FROZEN

    kv_cache_gib: int = Field(default=2, ge=1, description=(
        "CPU: KV cache per engine, whole GiB (vLLM's VLLM_CPU_KVCACHE_SPACE)"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description=(
            "the engines' weights and activations: auto = bfloat16 on a GPU, float32 on a CPU "
            "(bf16 on a CPU changed answers, even with AMX)"))
    max_model_len: int = Field(default=4096, gt=0, description=(
        "the engines' context length, prompt and answer tokens"))
    lease_s: int = Field(default=ConnectorOptions.lease_s, gt=0, description=(
        "how long a prefill engine holds a prompt's KV for the decode engine to read it"))
    offload_gib: float = Field(default=ConnectorOptions.offload_tier_gib, ge=0, description=(
        "host-memory KV offload tier per engine, GiB (0 = none): evicted prefixes come back "
        "from it instead of being recomputed"))
    offload_eviction: Literal["lru", "arc"] = Field(
        default=ConnectorOptions.offload_eviction_policy,
        description="which chunk a full offload tier drops")
    offload_store_threshold: int = Field(default=ConnectorOptions.offload_store_threshold, ge=0,
                                         description=(
        "store a block in the tier only once it was offered this many times"))
    offload_fs_dir: str | None = Field(default=ConnectorOptions.offload_fs_dir, description=(
        "GPU only: a file-system KV tier under the host tier, in this directory"))
    kv_blocks: int | None = Field(default=None, gt=0, description=(
        "cap each engine's KV cache at this many blocks (tests, benchmarks)"))
    engine_dev_endpoints: bool = Field(default=False, description=(
        "expose vLLM's dev endpoints on the engines (testbeds, benchmarks)"))
    otlp_traces_endpoint: str | None = Field(default=None, description=(
        "export one OpenTelemetry trace per request, from the proxy and both engines, to this "
        "OTLP endpoint (protocol: $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, grpc or http/protobuf)"))

    def connector(self, *, cpu_fixes: bool) -> ConnectorOptions:
        return ConnectorOptions(
            lease_s=self.lease_s, cpu_fixes=cpu_fixes, offload_tier_gib=self.offload_gib,
            offload_eviction_policy=self.offload_eviction,
            offload_store_threshold=self.offload_store_threshold,
            offload_fs_dir=self.offload_fs_dir)

    def vllm_args(self) -> tuple[str, ...]:
        """vLLM arguments these settings add (a KV cache capped at ``kv_blocks`` blocks,
        tracing)."""
        args: tuple[str, ...] = ()
        if self.kv_blocks is not None:
            args += ("--num-gpu-blocks-override", str(self.kv_blocks))
        if self.otlp_traces_endpoint:
            args += ("--otlp-traces-endpoint", self.otlp_traces_endpoint)
        return args


class ProxySettings(BaseModel):
    """The proxy's operator knobs (defaults: ``ProxyConfig``'s)."""

    model_config = _FROZEN

    host: str = Field(default="127.0.0.1", description="the proxy's listen address")
    port: int = Field(default=8000, gt=0, lt=65536, description="the proxy's port")
    policy: str = Field(default=_proxy_default("policy"), description=(
        "auto (live cost model) | disaggregate | local | threshold:N"))
    slo_ttft_ms: float | None = Field(default=_proxy_default("slo_ttft_ms"), gt=0, description=(
        "time-to-first-token target: with a target set, the auto policy also weighs the "
        "streams decoding on an engine (a request's own 'slo' overrides)"))
    slo_itl_ms: float | None = Field(default=_proxy_default("slo_itl_ms"), gt=0, description=(
        "target for the longest gap between two tokens of a stream"))
    probe_tokens: tuple[int, ...] = Field(default=_proxy_default("probe_tokens"), description=(
        "prompt lengths of the start-up probes that seed the cost model, comma-separated "
        "('' for none)"))
    reprobe_s: float = Field(default=_proxy_default("reprobe_s"), ge=0, description=(
        "re-measure a prefill->decode link after this long without a hand-over (0 = never)"))
    prefill_deadline_s: float = Field(default=_proxy_default("prefill_deadline_s"), gt=0,
                                      description=(
        "give up on a prefill after this long and serve the request locally"))
    headers_deadline_s: float = Field(default=_proxy_default("headers_deadline_s"), gt=0,
                                         description=(
        "504 when the decode engine has not sent its response headers after this long"))
    idle_deadline_s: float = Field(default=_proxy_default("idle_deadline_s"), gt=0, description=(
        "end a stream with an in-band error when decode sends nothing this long"))
    total_deadline_s: float = Field(default=_proxy_default("total_deadline_s"), gt=0,
                                    description=(
        "end a request that is not over this long after it arrived: a 504, or an in-band "
        "timeout error once streaming (never continued elsewhere)"))
    migration_limit: int = Field(default=_proxy_default("migration_limit"), ge=0, description=(
        "continue a stream on another decode engine when its own is lost mid-answer, at most "
        "this many times (0 = end it with an in-band error)"))
    max_inflight: int = Field(default=_proxy_default("max_inflight"), gt=0, description=(
        "requests served at once (admission control)"))
    max_queued: int = Field(default=_proxy_default("max_queued"), ge=0, description=(
        "requests that may wait for a slot; beyond: 503 + Retry-After"))
    queue_timeout_s: float = Field(default=_proxy_default("queue_timeout_s"), gt=0,
                                   description=(
        "how long a request may wait for a slot before its 503"))
    api_key: str | None = Field(default=None, description=(
        "require this bearer token on /v1/* (default: $PDSERVE_API_KEY)"))
    private_ops: bool = Field(default=False, description=(
        "/health, /metrics and /pd/* need the API key too (default: public)"))

    @field_validator("policy")
    @classmethod
    def _check_policy(cls, v: str) -> str:
        parse_policy(v)
        return v

    def config(self, **wiring: Any) -> ProxyConfig:
        """The proxy's config: these settings plus what the launcher wired (urls, sizing)."""
        own = self.model_dump(exclude={"host", "port", "private_ops"})
        return ProxyConfig(**own, public_health=not self.private_ops, **wiring)


# --- flags ------------------------------------------------------------------------------------


#: Old flag names still accepted (field name -> old flag): each works as the field's own flag
#: does, and says once on stderr what to write instead.
DEPRECATED_FLAGS = {"headers_deadline_s": "--first-byte-deadline-s"}


class _Deprecated(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        new = "--" + self.dest.replace("_", "-")
        print(f"pdserve: {option_string} is deprecated, use {new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_arguments(parser: argparse._ActionsContainer, settings: type[BaseModel]) -> None:
    """One ``--flag`` per field of ``settings``: its type, default and help from the field
    (and the field's old name, ``DEPRECATED_FLAGS``, kept working)."""
    for name, field in settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if name in DEPRECATED_FLAGS:
            parser.add_argument(DEPRECATED_FLAGS[name], dest=name, action=_Deprecated,
                                type=_base_type(field.annotation), default=field.default,
                                help=f"deprecated name of {flag}")
        kind = _base_type(field.annotation)
        kwargs: dict[str, Any] = {"dest": name, "default": field.default,
                                  "help": field.description}
        if kind is bool:
            parser.add_argument(flag, action="store_true", **kwargs)
            continue
        if typing.get_origin(kind) is Literal:
            kwargs["choices"] = typing.get_args(kind)
        elif typing.get_origin(kind) is tuple:
            kwargs["type"] = _int_list
        else:
            kwargs["type"] = kind
        parser.add_argument(flag, **kwargs)


def from_args(settings: type[BaseModel], args: argparse.Namespace) -> Any:
    """The settings the flags of ``add_arguments`` gave, validated (a ``ValueError`` names
    the field)."""
    return settings(**{name: getattr(args, name) for name in settings.model_fields})


def flags(settings: type[BaseModel]) -> list[str]:
    return ["--" + name.replace("_", "-") for name in settings.model_fields]


def _base_type(annotation: Any) -> Any:
    """``int | None`` -> ``int``; everything else as it is."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")
