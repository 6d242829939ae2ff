"""``pdserve node-watch``: a worker node stops its own Ray when its head's Ray is gone.

With Ray's on-premises provider, ``ray down`` runs ``ray stop`` on the head only. A worker's
raylet then waits out Ray's GCS reconnect timeout (60 s by default) before it exits, and its
dashboard and runtime-env agents, finding the raylet gone without a SIGTERM, spend up to 60 s
more reporting that to the lost GCS: engines held a node's memory (or GPU) for a minute after
``ray down``, and Ray's own processes stayed for two.

The watch tells a head whose Ray is gone from a head it cannot reach:

- **refused**: the head's host answers, nothing listens on the GCS port. Ray was stopped there
  (``ray down``, ``ray stop``) or crashed; without GCS fault tolerance that cluster is over.
  After ``REFUSALS`` in a row the watch runs ``ray stop`` on its node (SIGTERM first: the agents
  exit at once) and exits.
- **silent**: no answer at all (a cut link, a partition, the head's host down). The watch does
  nothing: whether to wait is Ray's reconnect timeout's call, as without the watch.

It runs beside ``ray start --block`` in ``launch/cluster/onprem.yaml``'s worker start commands,
and exits by itself once the node's raylet, seen once, is gone (a ``ray stop`` by hand, or the
watch's own).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Literal

import psutil

from launch.ray_mode import split_address

log = logging.getLogger(__name__)

Probe = Literal["open", "refused", "silent"]
#: Refusals in a row that mean the head's Ray is gone (2 s apart: 6 s after ``ray down``).
REFUSALS = 3
INTERVAL_S = 2.0
CONNECT_TIMEOUT_S = 2.0


def probe(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Probe:
    """One TCP connect to ``host:port``: open, refused (the host answered with a reset), or
    silent (no answer within ``timeout_s``, or no route)."""
    host, port = split_address(address)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"


def head_is_gone(recent: Iterable[Probe], refusals: int = REFUSALS) -> bool:
    """The decision, pure: the last ``refusals`` probes were all refused. A silent probe (or an
    open one) among them means the head may only be out of reach: not gone."""
    last = list(recent)[-refusals:]
    return len(last) == refusals and all(p == "refused" for p in last)


def raylet_running() -> bool:
    for p in psutil.process_iter(["name"]):
        if p.info["name"] == "raylet":
            return True
    return False


def stop_ray() -> None:
    done = subprocess.run(["ray", "stop"], capture_output=True, text=True, timeout=120)
    log.warning("node-watch: ray stop exited %d: %s", done.returncode,
                (done.stdout + done.stderr).strip()[-500:])


def watch(address: str, *, interval_s: float = INTERVAL_S,
          probe_head: Callable[[str], Probe] = probe,
          local_ray: Callable[[], bool] = raylet_running,
          stop: Callable[[], None] = stop_ray,
          sleep: Callable[[float], None] = time.sleep) -> str:
    """Watch the head's GCS at ``address`` until it is gone (then ``stop``: returns
    ``"stopped"``) or this node's raylet, once seen, is gone (``"raylet gone"``)."""
    recent: list[Probe] = []
    seen_raylet = False
    while True:
        if local_ray():
            seen_raylet = True
        elif seen_raylet:
            log.warning("node-watch: this node's raylet is gone; nothing to watch")
            return "raylet gone"
        recent = [*recent, probe_head(address)][-REFUSALS:]
        if head_is_gone(recent):
            log.warning("node-watch: the head's Ray at %s refuses connections; stopping this "
                        "node's Ray", address)
            stop()
            return "stopped"
        sleep(interval_s)
