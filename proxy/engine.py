"""One engine as the proxy sees it: its client, role and duties, health, what it caches, and the
load its own metrics report (read each probe, ``transport.engine_metrics``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from proxy.engine_client import EngineClient, EngineStream
from proxy.prefix_index import PrefixIndex
from transport.engine_metrics import engine_load

Role = Literal["prefill", "decode", "both"]
Duty = Literal["prefill", "decode"]
BOTH: frozenset[str] = frozenset({"prefill", "decode"})


@dataclass(eq=False)
class Engine:
    role: Role
    client: EngineClient
    healthy: bool = False
    inflight: int = 0
    consecutive_failures: int = field(default=0)
    #: What this engine has cached (fed by its KV events; empty without them).
    index: PrefixIndex = field(default_factory=PrefixIndex)
    events_endpoint: str | None = None
    slow_probes: int = 0
    #: Requests the engine itself reports running + waiting (from its /metrics, each probe).
    engine_requests: int = 0
    #: Mean prompt tokens of the requests the engine finished lately (all clients), or None.
    mean_prompt_tokens: float | None = None
    _totals: tuple[float, float] | None = None  # (prompt tokens, finished requests) last probe
    #: NIXL's measured pull rate on this engine (bytes / transfer time, recent transfers), or
    #: None before any: wire time only, where the hand-over fit times all a user waits for.
    nixl_bytes_per_s: float | None = None
    _foreign: int = 0
    nixl_transfers: int = 0
    _nixl: tuple[float, float] | None = None  # (bytes, seconds) at the last probe
    #: KV pulls its NIXL reported failed since the proxy first read it (it then recomputed).
    kv_pull_failures: int = 0
    _nixl_failed: float | None = None  # the engine's own total at the last probe
    #: Held while its metrics are read (``EnginePool.look``): one reading at a time, in order.
    looking: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    #: Scale-down in progress: serves what it has, is picked for nothing new.
    draining: bool = False
    #: The streams being relayed from it now (``proxy/relay.py``): what a scale-down past its
    #: drain timeout moves to other engines (closing one makes its relay continue it elsewhere).
    open_streams: set[EngineStream] = field(default_factory=set)
    #: Which incarnation of the engine this is (directory-found engines; "" otherwise).
    instance: str = ""
    #: When it was last picked (a pool-wide sequence number): ties rotate.
    last_pick: dict[str, int] = field(default_factory=dict)  # per duty
    #: Up, but its NIXL handshakes with the other role are still being paid (it joined or came
    #: back after start-up): picked only when no other engine is usable.
    warming: bool = False
    #: The warm-up under way (``proxy/warmup.py``: one at a time; the newest clears ``warming``).
    warm_up: asyncio.Task | None = field(default=None, repr=False)
    #: What it is asked to do now ("prefill", "decode"); by default all its role can do.
    duties: frozenset[str] = frozenset()
    #: Tasks waiting on it for a whole reply (:meth:`given_up_when_down`), and those of them
    #: cancelled because it was marked down.
    #: Tasks waiting on the engine -> whether another engine must be up to give them up.
    _waiting: dict[asyncio.Task, bool] = field(default_factory=dict, repr=False)
    _given_up: set[asyncio.Task] = field(default_factory=set, repr=False)

    #: The client's name (read on every request's path: a plain attribute).
    name: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.name = getattr(self.client, "name", "")  # (tests may give no client)
        if not self.duties:
            self.duties = BOTH if self.role == "both" else frozenset({self.role})

    def can(self, duty: Duty) -> bool:
        """Whether the engine's role allows ``duty`` (assigned or not)."""
        return self.role in (duty, "both")

    @property
    def open(self) -> bool:
        """Whether it may be sent new work of any kind (a warm-up, a probe): up, not draining,
        and not cordoned (a fixed-role engine left out of its role's duty: ``EnginePool.assign``;
        a ``both`` engine without a duty now is still warmed for the duties it may be given)."""
        return self.healthy and not self.draining and (self.role == "both"
                                                       or self.role in self.duties)

    def update_load(self, metrics_text: str) -> int:
        """Take in a look at the engine's metrics; the KV pulls that failed since the last
        look (the first look is the baseline). A figure the page gave no finite value for
        (None: ``transport/engine_metrics.py``) keeps the last look's."""
        load = engine_load(metrics_text)
        if (requests := load.requests) is not None:
            self.engine_requests = requests
            self._foreign = max(0, requests - self.inflight)
        if load.prompt_tokens is not None and load.requests_finished is not None:
            totals = (load.prompt_tokens, load.requests_finished)
            if self._totals is not None:
                d_tokens, d_requests = totals[0] - self._totals[0], totals[1] - self._totals[1]
                if d_requests > 0 and d_tokens >= 0:
                    mean = d_tokens / d_requests
                    self.mean_prompt_tokens = mean if self.mean_prompt_tokens is None else (
                        0.7 * self.mean_prompt_tokens + 0.3 * mean)
            self._totals = totals
        if load.nixl_bytes is not None and load.nixl_seconds is not None:
            nixl = (load.nixl_bytes, load.nixl_seconds)
            if self._nixl is not None:
                d_bytes, d_s = nixl[0] - self._nixl[0], nixl[1] - self._nixl[1]
                if d_bytes > 0 and d_s > 0:
                    rate = d_bytes / d_s
                    self.nixl_bytes_per_s = rate if self.nixl_bytes_per_s is None else (
                        0.5 * self.nixl_bytes_per_s + 0.5 * rate)
            self._nixl = nixl
        if load.nixl_transfers is not None:
            self.nixl_transfers = int(load.nixl_transfers)
        if load.nixl_failed is None:
            return 0
        failed = 0 if self._nixl_failed is None else max(0, int(load.nixl_failed
                                                                - self._nixl_failed))
        self._nixl_failed = load.nixl_failed
        self.kv_pull_failures += failed
        return failed

    @property
    def foreign_requests(self) -> int:
        """Requests on the engine that this proxy did not send (other clients or proxies), as of
        the last look at its metrics. Counted then, against what this proxy had in flight then:
        subtracting today's in-flight count from a reading up to a second old would count this
        proxy's own requests that finished since as somebody else's queue."""
        return self._foreign

    @contextlib.contextmanager
    def given_up_when_down(self, if_replaced: bool = False) -> Iterator[None]:
        """Wait on the engine inside this block, and stop waiting when it is marked down: the
        block then raises :class:`EngineLost` (its await cancelled, which closes the request and
        makes the engine abort it if it ever reads again). Without this, a request sent to an
        engine that went silent (a cut link: nothing answers, nothing refuses; a hung engine)
        would wait out its deadline although the proxy already knows the engine is gone.
        ``if_replaced``: only when another engine can take the request over (a decode wait:
        with none, the engine may only be slow, and given up the request would fail)."""
        task = asyncio.current_task()
        assert task is not None
        self._waiting[task] = if_replaced
        try:
            yield
        except asyncio.CancelledError:
            # Not ours, or ours and the client's in the same breath (a cancel still pending
            # after ours is taken back): the client's wins, the request is aborted.
            if task not in self._given_up or task.uncancel() > 0:
                raise
            raise EngineLost(f"{self.name} was marked down while it had the request") from None
        finally:
            self._waiting.pop(task, None)
            self._given_up.discard(task)

    def give_up_waiting(self, replaced: bool) -> None:
        """Make the :meth:`given_up_when_down` blocks waiting on the engine raise EngineLost
        (it was marked down); ``replaced``: another engine can take over a decode wait."""
        for task, if_replaced in list(self._waiting.items()):
            if task not in self._given_up and (replaced or not if_replaced):
                self._given_up.add(task)
                task.cancel()


class EngineLost(Exception):
    """The engine was marked down while a request waited on it."""


@dataclass(frozen=True)
class EndpointInfo:
    """One engine as a directory (Ray mode) reports it."""

    name: str
    role: Role
    url: str
    kv_events: str | None = None
    #: Changes when the engine is restarted, even at the same url (e.g. "host:pid").
    instance: str = ""
