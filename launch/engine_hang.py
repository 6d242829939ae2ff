"""When is a live engine hung: a pure rule over its health checks.

An engine whose process runs but whose server no longer answers (stopped by a signal,
deadlocked, its event loop stuck) never exits, so the watchdog's exit path would never replace
it (``launch/ray_engine.py``). Once the engine was ready, the watchdog checks its ``/health``
every :attr:`HangDetector.interval_s` and feeds each outcome here; the engine is hung after
``min_failures`` failed checks in a row that span more than ``timeout_s`` (from the first
failed check's start to the last's). Any answered check starts the count again. The caller
kills the engine; the detector reads no clock.
"""

from __future__ import annotations

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
