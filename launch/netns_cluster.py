"""A two-node Ray cluster on one machine: the head in the root network namespace, a worker node in
a network namespace of its own, joined by the testbed's veth link (``launch/testbed.py``), which
``tc`` shapes like an inter-node link.

::

    root namespace                                  netns <link.netns>, own PID namespace
    Ray head (GCS, raylet) on link.host_addr        Ray worker raylet on link.ns_addr
    resources: {head_resource: 100}                 resources: {worker_resource: 100}
    (each a name, or several comma-separated)
    <== veth, shaped by link.set_rate ==>

Each node's engines bind that node's address (``launch/ray_engine.py``), so KV between an engine on
the worker and one on the head crosses the shaped link, and KV within a node does not. Start
``pdserve ray --address <cluster.address> --prefill-on <worker_resource> --decode-on
<head_resource>`` (or the reverse) against it.

What it is not (issue 18's item 1): the worker is not started by ``ray up`` over SSH, and it shares
the host's filesystem, home and venv. Both nodes run this machine's Ray from this venv.

The cluster uses Ray's token authentication (``RAY_AUTH_MODE=token``; the token is
``~/.ray/auth_token``, made by ``ray get-auth-token --generate`` when missing): a node reachable
over a network should not run whatever any host sends it. ``auth_env`` is the environment every
process that talks to the cluster (the worker node, pdserve) needs. On one machine the two nodes
share the token file; on two machines it would be copied to the worker.

``lose_worker`` SIGKILLs every process in the worker's namespace (its raylet, its Ray workers and
the engines they host), as a node that loses power; ``rejoin_worker`` starts it again. ``stop``
ends this cluster's processes only (those of its Ray session, and everything in the namespace),
not ``ray stop``, which would end every Ray cluster on the machine.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch.testbed import ThrottledLink

log = logging.getLogger(__name__)

GCS_PORT = 6390
START_TIMEOUT_S = 120.0


class NetnsRayCluster:
    """``with NetnsRayCluster(link, ...) as cluster:`` a head and a worker node; on leaving, this
    cluster's processes stopped and the link destroyed (when it was created here, which it is
    unless it already was)."""

    def __init__(self, link: ThrottledLink, head_resource: str, worker_resource: str,
                 num_cpus: int = 2, gcs_port: int = GCS_PORT) -> None:
        self.link = link
        self.head_resource = head_resource
        self.worker_resource = worker_resource
        self.num_cpus = num_cpus
        self.gcs_port = gcs_port
        self._created_link = False
        self._session = ""  # the head's Ray session directory name, once started
        self._worker: subprocess.Popen[bytes] | None = None  # the worker node's ``ray start``

    @property
    def address(self) -> str:
        return f"{self.link.host_addr}:{self.gcs_port}"

    auth_env = {"RAY_AUTH_MODE": "token"}

    def _ray(self, *args: str, netns: bool = False) -> str:
        ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
        argv = [ray, *args]
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **self.auth_env)
        if netns:
            argv = self.link.wrap(argv)  # ip netns exec keeps the environment
        return subprocess.run(argv, env=env, check=True, timeout=START_TIMEOUT_S, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE).stdout

    def start(self) -> NetnsRayCluster:
        self._ray("get-auth-token", "--generate")
        if not self.link.created:
            self.link.create()
            self._created_link = True
        self._ray("start", "--head", f"--node-ip-address={self.link.host_addr}",
                  f"--port={self.gcs_port}", f"--num-cpus={self.num_cpus}",
                  f"--resources={_offered(self.head_resource)}", "--include-dashboard=false",
                  "--disable-usage-stats")
        self._session = Path("/tmp/ray/session_latest").resolve().name
        self.rejoin_worker()
        log.info("two-node Ray cluster at %s (worker %s in netns %s)", self.address,
                 self.link.ns_addr, self.link.netns)
        return self

    def rejoin_worker(self) -> None:
        """Start the worker node (again): its raylet joins the head over the link. The node runs
        in a PID namespace of its own, as on a machine of its own: UCX's shared-memory transport
        (``cma``) reaches only processes of one PID namespace, so KV between the nodes takes
        the shaped link (tcp) as between two machines, and KV within a node shared memory.
        ``ray start --block`` is the namespace's first process: when it ends, the node ends."""
        ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
        argv = self.link.wrap(["unshare", "--pid", "--fork", "--mount-proc", ray, "start",
                               "--block", f"--address={self.address}",
                               f"--node-ip-address={self.link.ns_addr}",
                               f"--num-cpus={self.num_cpus}",
                               f"--resources={_offered(self.worker_resource)}",
                               "--disable-usage-stats"])
        self._reap_worker()
        self._worker_log = open(f"/tmp/pdserve-netns-worker-{self.link.netns}.log", "ab")
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **self.auth_env)
        self._worker = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                        stdout=self._worker_log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any(b"raylet" in _cmdline(pid) for pid in self.worker_pids()):
            if self._worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker node did not start (exit {self._worker.poll()}; "
                                   f"see {self._worker_log.name})")
            time.sleep(0.2)

    def _reap_worker(self) -> None:
        """Wait for the last worker's ``ray start`` once it is gone (no zombie left behind)."""
        worker = self._worker
        if worker is not None:
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self._worker_log.close()
            self._worker = None

    def worker_pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.link.netns], capture_output=True,
                             text=True, timeout=10).stdout
        return [int(p) for p in out.split()]

    def pids(self) -> list[int]:
        """Every process of this cluster still running, on either node."""
        return sorted(set(self.worker_pids()) | set(self._session_pids()))

    def lose_worker(self) -> None:
        """SIGKILL everything on the worker node, at once (a node that loses power)."""
        _kill(self.worker_pids(), signal.SIGKILL)

    def _session_pids(self) -> list[int]:
        """This cluster's processes: the ones naming its session, and the ones naming its GCS
        address (Ray's client server names only that, and outlived every test run)."""
        found = []
        marks = [m.encode() for m in (self._session, f"--address={self.address}") if m]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if self._session and any(m in cmdline for m in marks):
                    found.append(int(entry.name))
        return found

    def stop(self) -> None:
        """SIGTERM this cluster's processes, SIGKILL what is left after 3 s; then the link
        (when this object made it). (Ray's GCS server, raylet and autoscaler were all still
        there 10 s after a SIGTERM, measured; nothing of a test cluster needs saving.)"""
        for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            pids = self.pids()
            if not pids:
                break
            _kill(pids, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and (self.worker_pids() or self._session_pids()):
                time.sleep(0.2)
        # What `ray stop` does too: a later `ray.init()` with no address would otherwise read
        # this dead cluster's address from the file that `ray start --head` wrote, and join it.
        self._reap_worker()
        current = Path("/tmp/ray/ray_current_cluster")
        try:
            if current.read_text().strip() == self.address:
                current.unlink()
        except OSError:
            pass
        if self._created_link:
            self.link.destroy()

    def __enter__(self) -> NetnsRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _offered(resources: str) -> str:
    """A node's ``--resources``: each of the comma-separated names, 100 of it."""
    return json.dumps({r: 100 for r in resources.split(",") if r})


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _kill(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
