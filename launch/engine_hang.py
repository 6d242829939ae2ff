"""When is a live engine hung: a pure rule over its health checks.

An engine whose process runs but whose server no longer answers (stopped by a signal,
deadlocked, its event loop stuck) never exits, so the watchdog's exit path would never replace
it (``launch/ray_engine.py``). Once the engine was ready, the watchdog checks its ``/health``
every :attr:`HangDetector.interval_s` (:meth:`HangDetector.poll`); the engine is hung after
``min_failures`` failed checks in a row that span more than ``timeout_s`` (from the first
failed check's start to the last's). Any answered check starts the count again. Both
watchdogs use it: Ray mode's actor (``launch/ray_engine.py``) and dev mode's supervisor
(``launch/supervisor.py``). The caller kills the engine; the detector reads no clock (the
caller passes the time in).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: ``--hang-timeout-s``'s default, in dev and Ray mode.
DEFAULT_TIMEOUT_S = 60.0
#: The longest a check waits for its answer: an engine busy computing still answers /health
#: well within it (its server answers between steps).
CHECK_TIMEOUT_S = 5.0


@dataclass
class HangDetector:
    timeout_s: float
    min_failures: int = 3
    failures: int = 0
    first_failure_s: float = 0.0
    #: When the next check is due (monotonic seconds).
    next_check_s: float = 0.0
    #: It found the engine hung: it checks no more (a fresh engine gets a fresh detector).
    fired: bool = False

    @property
    def interval_s(self) -> float:
        """How often to check: about six checks per timeout, between 0.25 s and 5 s apart."""
        return min(5.0, max(0.25, self.timeout_s / 6))

    @property
    def check_timeout_s(self) -> float:
        """Each check's deadline: as far apart as the checks, at least 1 s, at most
        :data:`CHECK_TIMEOUT_S`."""
        return min(CHECK_TIMEOUT_S, max(1.0, self.timeout_s / 6))

    def observe(self, answered: bool, at_s: float) -> bool:
        """Record a check started at ``at_s`` (monotonic seconds); True when the engine is now
        to be taken as hung."""
        if answered:
            self.failures = 0
            return False
        if self.failures == 0:
            self.first_failure_s = at_s
        self.failures += 1
        return self.failures >= self.min_failures and at_s - self.first_failure_s > self.timeout_s

    def poll(self, healthy: Callable[[float], bool], now_s: float) -> bool:
        """Check the engine when a check is due (``healthy(check_timeout_s)``: did its /health
        answer in time); True once, the first time it is found hung."""
        if self.fired or now_s < self.next_check_s:
            return False
        self.next_check_s = now_s + self.interval_s
        self.fired = self.observe(healthy(self.check_timeout_s), now_s)
        return self.fired

    def why(self, now_s: float) -> str:
        return (f"its /health unanswered for {now_s - self.first_failure_s:.0f} s "
                f"({self.failures} checks in a row)")
