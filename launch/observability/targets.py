"""The deployment's scrape targets as a Prometheus file-based service discovery file
(``file_sd_configs``), rewritten whenever the set changes: Ray restarts an engine on new ports,
``pdserve scale`` adds and removes some. Prometheus re-reads the file on change.

Each target carries ``role`` (proxy, prefill, decode, both) and, for engines, ``pd_engine``: the
name the proxy gives the engine (``decode-1``), the one its own ``pd_*`` series use. (Not
``engine``: vLLM's series have an ``engine`` label of their own, the engine-core index.)"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from proxy.directory import Directory
from proxy.engine import EndpointInfo

#: (name, role, url) of one engine, as the proxy names it.
EngineTarget = tuple[str, str, str]


def host_port(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


def target_groups(proxy_url: str, engines: Iterable[EngineTarget]) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = [
        {"targets": [host_port(proxy_url)], "labels": {"role": "proxy"}}]
    for name, role, url in sorted(engines):
        groups.append({"targets": [host_port(url)],
                       "labels": {"role": role, "pd_engine": name}})
    return groups


class TargetsFile:
    """One deployment's file; :meth:`update` writes it (atomically) only when it changes."""

    def __init__(self, path: Path, proxy_url: str):
        self.path = path
        self.proxy_url = proxy_url
        self._last: list[dict[str, Any]] | None = None

    def update(self, engines: Iterable[EngineTarget]) -> bool:
        groups = target_groups(self.proxy_url, engines)
        if groups == self._last:
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups, indent=1))
        os.replace(tmp, self.path)  # Prometheus never reads half a file
        self._last = groups
        return True


class ObservedDirectory:
    """A :class:`proxy.directory.Directory` that also keeps a :class:`TargetsFile` current with
    what it finds (Ray mode: the engines are only known through Ray)."""

    def __init__(self, directory: Directory, targets: TargetsFile):
        self._directory = directory
        self._targets = targets

    async def endpoints(self) -> list[EndpointInfo]:
        infos = await self._directory.endpoints()
        self._targets.update((i.name, i.role, i.url) for i in infos)
        return infos
