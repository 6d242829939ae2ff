"""How the proxy learns its engines at run time, how it asks for more or fewer, and how it
has a hung one restarted.

Dev mode passes fixed urls in the config and needs neither a directory nor a scaler; its
restarter is its supervisor's (``launch/supervisor.py``). Ray mode (``launch/ray_actors.py``)
implements all three over Ray actors; the proxy itself never imports Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from proxy.pool import EndpointInfo, Role


class Directory(Protocol):
    async def endpoints(self) -> list[EndpointInfo]:
        """Every engine that exists now (starting, ready or restarting), by name."""
        ...


class Scaler(Protocol):
    async def replicas(self, role: Role) -> list[str]:
        """Names of the engines of ``role``, oldest first; engines dead for good (that will
        never serve again) are stopped and left out, so they are neither counted nor kept."""
        ...

    async def add(self, role: Role, count: int) -> list[str]:
        """Start ``count`` more engines of ``role``; return their names (they join the
        directory at once and are routed to once they answer /health)."""
        ...

    async def remove(self, names: Sequence[str]) -> None:
        """Stop these engines (the proxy has drained them)."""
        ...

    async def reconcile(self, declared: Mapping[str, int]) -> Mapping[str, Sequence[str]]:
        """Keep each role at its ``declared`` count: stop the engines dead for good and start
        fresh ones in their place (a crash loop is given up on, and says so in the log);
        return the engines started, by role. Called periodically, never during a scale."""
        ...


class Restarter(Protocol):
    async def restart(self, name: str, url: str) -> None:
        """Kill the engine ``name`` at ``url`` so that its launcher starts it afresh (its core
        is hung behind a live API server: ``proxy/stalls.py``). Returns once asked."""
        ...
