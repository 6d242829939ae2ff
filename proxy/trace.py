"""When a request's stages happened, and the bookkeeping deferred until the client has bytes.

None of the deferred work (cost-model fits, histograms) changes the request's route, so none
of it belongs on its critical path: it runs after the first bytes went out, or when the request
ends without them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Trace:
    t_start: float
    #: The prefill leg ended (hand-off received, or given up): the hand-over starts.
    t_handoff: float = 0.0
    #: The decode request was (last) sent.
    t_decode_sent: float = 0.0
    #: The client had the first bytes (0: not yet).
    t_first: float = 0.0
    deferred: list[Callable[[], None]] = field(default_factory=list)

    def defer(self, work: Callable[[], None]) -> None:
        self.deferred.append(work)

    def run_deferred(self) -> None:
        work, self.deferred = self.deferred, []
        for fn in work:
            fn()
