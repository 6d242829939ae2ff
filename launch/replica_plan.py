"""Keeping a Ray deployment at its declared size: a pure decision.

Given the number of engines declared per role (at start-up, then by each scale order), each
engine's state and the crash-loop record, :func:`plan_replicas` says which engines to stop and
how many fresh ones to start. :meth:`launch.ray_actors.RayScaler.reconcile` gathers the states
(the actors' ``info``) and does what it returns; it reads no clock and does no I/O.

An engine is dead for good when its actor died with no restart left, or its engine failed
before it was ever ready (an actor whose engine never started is not restarted by Ray: the
watchdog reports it instead, ``launch/ray_engine.py``). It is stopped, and its role short of
its declared count gets a fresh actor. A crash loop is guarded: a replacement that dies before
it was ever seen ready is a strike for its role, the next replacement waits a pause that
doubles with each strike in a row, and at ``max_strikes`` the role is left short (an operator's
scale order clears the strikes). A replacement seen ready clears them too.

An engine can also be stuck: starting, never failing and never ready (a load that hangs, an
actor waiting for a node that is gone). One not seen ready for ``ready_within_s`` since it was
started or last ready (``pdserve ray --start-timeout-s``: what start-up waits for the first
engines) is taken as dead for good (:func:`judge`), so a stuck replacement is a strike too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

#: ``ready``: answers /health; ``starting``: may serve (starting, restarting, not answering
#: yet); ``dead``: will never serve again.
State = Literal["ready", "starting", "dead"]


@dataclass(frozen=True)
class Replica:
    name: str
    role: str
    state: State
    #: Started by a reconcile and never seen ready since.
    replacement: bool = False
    #: Why it is dead (its engine's last error, or its actor's death).
    cause: str | None = None
    #: Seconds since it was started or last seen ready (0 when ready).
    unready_s: float = 0.0


@dataclass(frozen=True)
class Strikes:
    """A role's replacements in a row that died before they were ever ready."""

    count: int = 0
    #: When the last was found dead (monotonic seconds).
    at_s: float = 0.0


@dataclass(frozen=True)
class ReplicaRule:
    first_pause_s: float = 10.0
    max_pause_s: float = 160.0
    #: Strikes in a row after which a role is no longer replaced.
    max_strikes: int = 4
    #: A starting engine not seen ready this long since it started or was last ready is
    #: dead for good (stuck).
    ready_within_s: float = 900.0

    def pause_s(self, strikes: int) -> float:
        """How long after its last strike a role's next replacement waits."""
        return 0.0 if strikes <= 0 else min(self.max_pause_s,
                                            self.first_pause_s * 2.0 ** (strikes - 1))


@dataclass(frozen=True)
class Plan:
    #: Engines dead for good: stop them (their actors are killed).
    stop: tuple[str, ...] = ()
    #: Role -> fresh engines to start now.
    start: Mapping[str, int] = field(default_factory=dict)
    #: Every role's strikes after this round.
    strikes: Mapping[str, Strikes] = field(default_factory=dict)
    #: Roles whose strikes reached the limit in this round (they are no longer replaced).
    gave_up: tuple[str, ...] = ()


def judge(replica: Replica, rule: ReplicaRule = ReplicaRule()) -> Replica:
    """``replica``, or dead for good when it has been starting longer than the rule allows."""
    if replica.state != "starting" or replica.unready_s <= rule.ready_within_s:
        return replica
    return replace(replica, state="dead", cause=(
        f"not ready {replica.unready_s:.0f} s after it was started or last ready (stuck "
        f"starting; the limit is --start-timeout-s, {rule.ready_within_s:.0f} s)"))


def plan_replicas(declared: Mapping[str, int], replicas: Sequence[Replica],
                  strikes: Mapping[str, Strikes], now_s: float,
                  rule: ReplicaRule = ReplicaRule()) -> Plan:
    """Stop every engine dead for good; start as many as each role in ``declared`` is short
    of (engines starting count: they may serve), unless its crash loop says wait or stop.
    Never removes a live engine (scaling down drains first: the proxy's job). A role not in
    ``declared`` has its strikes counted, and nothing started."""
    start: dict[str, int] = {}
    after: dict[str, Strikes] = dict(strikes)
    gave_up: list[str] = []
    for role in sorted({*declared, *(r.role for r in replicas)}):
        mine = [r for r in replicas if r.role == role]
        before = after.get(role, Strikes())
        now = Strikes() if any(r.replacement and r.state == "ready" for r in mine) else before
        failed = sum(r.replacement and r.state == "dead" for r in mine)
        if failed:
            now = Strikes(now.count + failed, now_s)
        after[role] = now
        if now.count >= rule.max_strikes:
            if before.count < rule.max_strikes:
                gave_up.append(role)
            continue
        short = declared.get(role, 0) - sum(r.state != "dead" for r in mine)
        if short > 0 and now_s >= now.at_s + rule.pause_s(now.count):
            start[role] = short
    return Plan(stop=tuple(r.name for r in replicas if r.state == "dead"), start=start,
                strikes=after, gave_up=tuple(gave_up))
