"""The proxy's configuration: validated once, at the edge, into an immutable object."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from proxy.deadlines import Deadlines
from proxy.policy import parse_policy
from transport.connector import ConnectorOptions


class ProxyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    #: Engines that can do either per request (vLLM's ``kv_both``), named ``engine-<i>``.
    pool_urls: tuple[str, ...] = ()
    pool_kv_events: tuple[str, ...] = ()
    #: What the pool engines are asked to do at start: ``pool`` (each prefills for the others
    #: and decodes: the policy picks local or P/D per request) or ``aggregated`` (each serves
    #: whole requests). Fixed-role engines (``prefill_urls``, ``decode_urls``) always do their
    #: role. Changed at run time with ``POST /pd/admin/routing``.
    layout: Literal["pool", "aggregated"] = "pool"
    served_model_names: tuple[str, ...] = Field(min_length=1)
    #: ZMQ endpoints of each engine's KV events (aligned with the urls; empty = not published).
    prefill_kv_events: tuple[str, ...] = ()
    decode_kv_events: tuple[str, ...] = ()
    #: A local model/tokenizer directory: lets the proxy size prompts exactly and look them up
    #: in the engines' prefix indexes before routing.
    tokenizer: str | None = None
    #: Worker processes that tokenize prompts (off the event loop; ``proxy/tokenizer_pool.py``).
    tokenizer_workers: int = Field(default=2, ge=1, le=64)
    #: Prompts of at most this many characters are tokenized on the event loop (the hop to a
    #: worker costs more than they do).
    tokenizer_inline_chars: int = Field(default=1000, ge=0)
    #: The engines' context length: a prompt surely longer is refused (400) without being
    #: tokenized. None: every prompt goes to the engines' own check.
    max_model_len: int | None = Field(default=None, gt=0)
    policy: str = "auto"
    #: Latency targets (ms) for every request (a request's own ``slo`` overrides them): with
    #: any set, ``auto`` protects the streams decoding on an engine from a local prefill that
    #: would break them (``proxy/policy.py``). None: ``auto`` minimises TTFT alone.
    slo_ttft_ms: float | None = Field(default=None, gt=0)
    slo_itl_ms: float | None = Field(default=None, gt=0)
    #: The decode engines' prefill chunk (their ``--max-num-batched-tokens``).
    decode_chunk_tokens: int = Field(default=2048, gt=0)
    #: KV bytes one prompt token moves over the link (``transport.kv_size``); needed by ``auto``.
    kv_bytes_per_token: int | None = Field(default=None, gt=0)
    #: Prompt lengths (tokens, approximate) of the start-up probes that seed the cost model,
    #: each sent once per route and pair. Empty = no probes (priors until traffic teaches).
    probe_tokens: tuple[int, ...] = (64, 256, 1024)
    #: Re-measure a pair's link with one disaggregated probe when it saw no hand-over for this
    #: long (0 = never).
    reprobe_s: float = Field(default=30.0, ge=0)
    #: Export one OpenTelemetry trace per request here (OTLP; None: tracing off, nothing
    #: created). The protocol is ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, as for vLLM.
    otlp_traces_endpoint: str | None = None
    #: The bearer token clients must send on /v1/* (None: open).
    api_key: str | None = Field(default=None, repr=False)
    #: The deployment's secret the proxy sends its engines (``launch/engine_guard.py``); None:
    #: engines that take anyone's calls.
    engine_key: str | None = Field(default=None, repr=False)
    #: When False, /health and /metrics also require the API key.
    public_health: bool = True
    body_limit_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    #: A client must finish sending its body within this many seconds (slow-loris guard).
    body_read_deadline_s: float = Field(default=30.0, gt=0)
    #: ...and a request's headers within this many seconds of its first byte (408, closed).
    header_read_deadline_s: float = Field(default=10.0, gt=0)
    #: Admission control: requests served at once, requests allowed to wait, and for how long.
    max_inflight: int = Field(default=256, gt=0)
    max_queued: int = Field(default=256, ge=0)
    queue_timeout_s: float = Field(default=10.0, gt=0)
    health_interval_s: float = Field(default=1.0, gt=0)
    #: Wake a probe this often to measure event-loop lag (``pd_event_loop_lag_seconds``);
    #: stalls shorter than the interval are seen only now and then. 0 = off.
    loop_lag_probe_s: float = Field(default=0.1, ge=0)
    #: Run one P/D request per prefill x decode pair before reporting ready (pays the NIXL
    #: handshake at start-up instead of in a user's first request).
    warmup: bool = True
    prefill_deadline_s: float = Field(default=120.0, gt=0)
    headers_deadline_s: float = Field(default=120.0, gt=0)
    idle_deadline_s: float = Field(default=60.0, gt=0)
    total_deadline_s: float = Field(default=600.0, gt=0)
    #: The prefill engines' KV lease (``ConnectorOptions.lease_s``): a hand-off older than
    #: 80 % of it is not sent to another decode engine on a retry (it recomputes instead).
    kv_lease_s: float = Field(default=ConnectorOptions.lease_s, gt=0)
    #: Times a request may move to another decode engine when its own is lost mid-answer
    #: (``proxy/migration.py``); 0 = never.
    migration_limit: int = Field(default=3, ge=0)
    #: An engine down because its core hung behind a live API server (``proxy/stalls.py``)
    #: is restarted after this long down, by the launcher's ``Restarter``; 0 = never (dev and
    #: Ray mode pass their ``--hang-timeout-s``).
    hung_restart_s: float = Field(default=0.0, ge=0)

    @field_validator("policy")
    @classmethod
    def _check_policy(cls, v: str) -> str:
        parse_policy(v)
        return v

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "ProxyConfig":
        if self.total_deadline_s < self.headers_deadline_s:
            raise ValueError("total_deadline_s must be >= headers_deadline_s")
        if not self.decode_urls and not self.pool_urls:
            raise ValueError("need an engine that decodes: decode_urls or pool_urls")
        if len(self.prefill_kv_events) not in (0, len(self.prefill_urls)) or len(
            self.decode_kv_events
        ) not in (0, len(self.decode_urls)) or len(self.pool_kv_events) not in (
            0, len(self.pool_urls)
        ):
            raise ValueError("kv event endpoints must match the engine urls one to one")
        if self.policy == "auto" and self.kv_bytes_per_token is None:
            raise ValueError("policy 'auto' needs kv_bytes_per_token (from the model config)")
        return self

    def deadlines(self) -> Deadlines:
        return Deadlines(
            prefill_s=self.prefill_deadline_s,
            headers_s=self.headers_deadline_s,
            idle_s=self.idle_deadline_s,
            total_s=self.total_deadline_s,
            handoff_max_age_s=0.8 * self.kv_lease_s,
        )
