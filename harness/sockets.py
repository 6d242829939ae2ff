"""What a running deployment listens on: every listening TCP socket and bound Unix socket of a
set of processes and all their descendants, for tests that check addresses."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str
    address: str  # "127.0.0.1:8100", "[::]:5600", or a Unix socket's path

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0].strip("[]")


def tree(pids: Iterable[int]) -> dict[int, psutil.Process]:
    """``pids`` and all their live descendants."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for p in (root, *root.children(recursive=True)):
                found[p.pid] = p
        except psutil.NoSuchProcess:
            continue
    return found


def tcp_listeners(pids: Iterable[int]) -> list[Listener]:
    out = []
    for pid, p in tree(pids).items():
        try:
            name = p.name()
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                ip, port = c.laddr
                host = f"[{ip}]" if ":" in ip else ip
                out.append(Listener(pid, name, f"{host}:{port}"))
    return out


def unix_listeners(pids: Iterable[int]) -> list[Listener]:
    """Unix sockets bound to a filesystem path (abstract ones, ``@...``, are left out: only
    the same network namespace reaches them). A listening socket's accepted connections carry
    its path too: compare sets of addresses."""
    out = []
    for pid, p in tree(pids).items():
        try:
            name = p.name()
            conns = p.net_connections(kind="unix")
        except psutil.Error:
            continue
        for c in conns:
            if c.laddr and c.laddr.startswith("/") and c.status in (psutil.CONN_LISTEN,
                                                                    psutil.CONN_NONE):
                out.append(Listener(pid, name, c.laddr))
    return out
