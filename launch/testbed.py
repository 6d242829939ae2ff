"""A real, throttled network link on one machine: the prefill side lives in its own netns.

Contract
--------
``ThrottledLink`` builds, on a Linux host where we are root, this topology::

    root namespace                         netns <name>
    (decode engine, proxy, callers)        (prefill engine, via link.wrap(argv))
    <name>-h  10.<octet>.0.1/24  <== veth ==>  <name>-n  10.<octet>.0.2/24   (+ its own lo, up)

and shapes both directions of the veth with ``tc`` (egress of ``<name>-h`` = traffic into the
netns, egress of ``<name>-n`` = traffic out of it), so a KV transfer between the two sides crosses a
link of known bandwidth (and optionally one-way delay) that can be *measured*, not just assumed.

Shaping is changed in place, never removed. ``create`` puts a tbf at the root of both ends while
nothing uses the link yet; every later ``set_rate`` only changes that tbf's parameters, and
"unthrottled" is the same tbf at ``OPEN_RATE_MBIT`` (1 Tbit/s: a veth here carries 28-30 Gbit/s
with no qdisc at all and 30-70 Gbit/s through this one, measured). Why: deleting or replacing a
root qdisc *grafts* a new one, and the kernel then deactivates the device and waits for an RCU
grace period (``dev_deactivate_many`` -> ``synchronize_rcu_expedited``) while holding RTNL, the
lock every ``ip``/``tc`` command needs. With engines moving KV across the link that wait took
~30.8 s in 4-6 of every 20-25 deletions here (0 of 20 with the engines paused, 0 of 12 under plain
TCP bulk traffic), and dmesg reported a stuck per-CPU workqueue at the same moments; 100 in-place
changes under the same traffic took milliseconds each. A grafted qdisc is also what a
``tc qdisc del`` that timed out left behind: the kernel finished the deletion after the timeout,
and the old code then re-applied the previous rate, so the link stayed throttled for the next test.
The netns has no default route: processes inside can reach only ``host_addr`` (and their own
loopback), so nothing started through ``wrap`` can send traffic anywhere else.

Who calls what, in which order:

1. Callers (tests, benchmarks, a dev-mode launcher) first check ``available()``: root, ``ip`` and
   ``tc`` present, and a trial ``ip netns add`` works. It never raises.
2. ``link.create()`` (or ``with ThrottledLink(...) as link:``). It first removes leftovers of the
   same name from a crashed earlier run (netns ``<name>``, veth ``<name>-h``), refuses to run if
   another interface or route already claims the subnet, then builds the topology. The link starts
   unthrottled. Another process can get a handle on an existing link with
   ``ThrottledLink.attach(name)``; it does not own the link.
3. ``link.set_rate(LinkSpec(rate_mbit=100))`` any number of times, without recreating anything;
   ``LinkSpec(None)`` removes the shaping. ``measure_mbit(link)`` measures real TCP goodput from the
   root namespace into the netns (``reverse=True``: out of the netns, the way KV flows when decode
   pulls from prefill). It counts payload bytes, so a rate of R Mbit/s reads as about 0.95 R:
   Ethernet/IP/TCP headers are charged to the link too.
4. The caller starts the prefill side with ``subprocess.Popen(link.wrap(argv), ...)``, points it at
   ``link.host_addr`` for anything in the root namespace, and points the root side at
   ``link.ns_addr``. The caller owns those processes and must stop them before step 5.
5. ``link.destroy()`` (or leaving the ``with`` block) deletes the veth pair and the netns. It is
   idempotent and never raises for things already gone, so it belongs in ``finally``. It never kills
   processes; if some are still inside the netns it warns (the namespace then lingers, detached and
   without a link, until they exit).

The owner of a ``ThrottledLink`` (whoever called ``create``) is the one who cleans up. One name =
one link: ``create`` on a second object with the same name treats the first one's netns and veth
as leftovers and replaces them; a different name on the same subnet is refused. Interface names
are limited to 15 characters, hence ``name`` to 13.

Delay (``LinkSpec.delay_ms``) uses netem. Kernels without it (the 6.18 Firecracker kernel this
was written on has only tbf/htb/ingress) make ``set_rate`` raise TestbedError for any delay and
leave the previous shaping in place; bandwidth shaping (tbf) works everywhere.

Every command runs with a timeout; a failing one raises ``TestbedError`` naming the command and
its stderr. A command that times out may still be inside the kernel (uninterruptible): it is
killed and waited for a bounded while more, and whatever it did or did not do is found out by
reading the state back, never assumed. ``set_rate`` reads both ends back after every change and
raises unless they show what was asked; ``spec`` is always what ``tc`` last showed.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LinkSpec", "TestbedError", "ThrottledLink", "available", "measure_mbit"]

CMD_TIMEOUT_S = 15.0
#: How long a command killed at its timeout may take to leave the kernel before we give up on
#: it (an RTNL wait measured here lasted ~31 s).
KILLED_EXIT_S = 45.0
#: The rate of an "unthrottled" link: its tbf stays, far above what a veth carries (module doc).
OPEN_RATE_MBIT = 1_000_000.0
#: The handle of the root qdisc on both ends: changed in place, never replaced.
ROOT_HANDLE = "1:"

# tc messages that mean "there was no root qdisc to delete": fine when removing shaping.
_NO_QDISC_MARKERS = (
    "Cannot delete qdisc with handle of zero",
    "No such file or directory",
    "Cannot find specified qdisc",
)
# ip messages that mean "already gone": fine when cleaning up.
_GONE_MARKERS = (
    "No such file or directory",
    "Cannot find device",
    "does not exist",
)


class TestbedError(RuntimeError):
    """A testbed command failed (the message names the command and carries its stderr)."""

    __test__ = False  # not a pytest test class despite the name


@dataclass(frozen=True)
class LinkSpec:
    """Shaping for each direction of the link.

    ``rate_mbit``: bandwidth in Mbit/s (10**6 bit/s) per direction; ``None`` = unthrottled.
    ``delay_ms``: one-way delay added in each direction (so the RTT grows by ``2 * delay_ms``).
    """

    rate_mbit: float | None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None, got {self.rate_mbit!r}")
        if not self.delay_ms >= 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms!r}")

    @property
    def unthrottled(self) -> bool:
        return self.rate_mbit is None and self.delay_ms == 0


UNTHROTTLED = LinkSpec(None)


def _run(
    argv: Sequence[str],
    timeout_s: float = CMD_TIMEOUT_S,
    ok_if: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """Run a command; raise TestbedError on failure unless stderr contains one of ``ok_if``."""
    cmd = " ".join(argv)
    try:
        child = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, text=True)
    except OSError as e:
        raise TestbedError(f"`{cmd}` could not run: {e}") from e
    try:
        out, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        wchan = _wchan(child.pid)
        child.kill()  # delivered when it leaves the kernel (an RTNL wait is uninterruptible)
        try:
            child.communicate(timeout=KILLED_EXIT_S)
            fate = "killed"
        except subprocess.TimeoutExpired:
            fate = f"still in the kernel {KILLED_EXIT_S:.0f}s after being killed"
        raise TestbedError(f"`{cmd}` timed out after {timeout_s:.0f}s (waiting in {wchan}); "
                           f"{fate}: what it changed is unknown until read back") from None
    proc = subprocess.CompletedProcess(list(argv), child.returncode, out, err)
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout or "").strip()
        if any(m in err for m in ok_if):
            return proc
        raise TestbedError(
            f"`{cmd}` failed with exit code {proc.returncode}: {err or '(no stderr)'}"
        )
    return proc


def _wchan(pid: int) -> str:
    """Where in the kernel ``pid`` waits (e.g. ``synchronize_rcu_expedited``), for errors."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def available() -> bool:
    """Whether this machine can host a ThrottledLink: root, ``ip`` and ``tc``, and netns creation.

    The trial creates and deletes a uniquely named namespace; it never raises.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    probe = f"pdtb-probe-{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe], timeout_s=10)
    except TestbedError:
        return False
    try:
        _run(["ip", "netns", "del", probe], timeout_s=10, ok_if=_GONE_MARKERS)
    except TestbedError:
        return False
    return True


def _tbf_params(rate_mbit: float) -> tuple[int, int]:
    """(burst bytes, queue limit bytes) for a tbf of ``rate_mbit``.

    burst: 4 ms worth of tokens, at least 3 full-size frames. That is rate/HZ at this kernel's
    HZ=250 (tbf also works below rate/HZ with high-resolution timers) and small enough that the
    initial full bucket barely skews a 2 s measurement at 1 Mbit/s. GSO packets larger than the
    burst are segmented by tbf itself.
    queue limit (the same thing as tbf's ``latency``, in bytes): 50 ms worth, at least 1 MiB.
    Measured here: with 64-192 KiB a single TCP stream at 10 Mbit/s saw tail drops on every
    transfer and once crawled at 0.6 Mbit/s for 30 s (retransmission timeouts); with 1 MiB there
    were no drops at 1-1000 Mbit/s. One bulk TCP stream (BBR here) then kept 30-200 KiB queued:
    ~0.8 s of queueing delay at 1 Mbit/s, ~0.1 s at 10 Mbit/s, a few ms at 100 Mbit/s -- a
    bloated but honest link; small messages sharing it with a bulk transfer wait behind it.
    Both are capped for the open shaper (1 Tbit/s): tbf takes 32-bit byte counts, and at that
    rate nothing queues.
    """
    rate_bps = rate_mbit * 1e6 / 8
    burst = min(1 << 30, max(3 * 1514, int(rate_bps * 0.004)))
    limit = min(64 << 20, max(1 << 20, int(rate_bps * 0.05)))
    return burst, limit


def _tbf_args(rate_mbit: float) -> list[str]:
    burst, limit = _tbf_params(rate_mbit)
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "limit", str(limit)]


def _same(a: LinkSpec, b: LinkSpec) -> bool:
    """Equal up to tc's rounding of what it prints (``33300Kbit``, ``415ms``)."""
    def close(x: float | None, y: float | None) -> bool:
        return x == y or (x is not None and y is not None and abs(x - y) <= 0.005 * max(x, y))
    return close(a.rate_mbit, b.rate_mbit) and close(a.delay_ms, b.delay_ms)


def _root_kind(qdisc_show: str) -> str | None:
    """The kind of the root qdisc in ``tc qdisc show dev X root`` output (``tbf``, ``netem``)."""
    words = qdisc_show.split()
    return words[1] if len(words) > 1 and words[0] == "qdisc" else None


_UNIT = {"bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3, "tbit": 1e6}


def _parse_spec(qdisc_line: str) -> LinkSpec:
    """The LinkSpec a ``tc qdisc show dev X root`` line stands for (tbf or netem; else none)."""
    rate = re.search(r"\brate (\d+(?:\.\d+)?)([KMGT]?bit)\b", qdisc_line, re.I)
    delay = re.search(r"\bdelay (\d+(?:\.\d+)?)(us|ms|s)\b", qdisc_line)
    rate_mbit = float(rate.group(1)) * _UNIT[rate.group(2).lower()] if rate else None
    delay_ms = 0.0
    if delay and "netem" in qdisc_line:
        delay_ms = float(delay.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[delay.group(2)]
    if rate_mbit is not None and "tbf" not in qdisc_line and "netem" not in qdisc_line:
        rate_mbit = None
    if rate_mbit is not None and rate_mbit >= OPEN_RATE_MBIT:
        rate_mbit = None  # the open shaper: unthrottled
    return LinkSpec(rate_mbit, delay_ms)


class ThrottledLink:
    """Netns ``name`` joined to the root namespace by a shaped veth pair (see the module doc)."""

    def __init__(self, name: str = "pdtb", subnet_octet: int = 231) -> None:
        if not name or len(name) > 13 or not all(c.isalnum() or c in "-_" for c in name):
            raise ValueError(
                f"name must be 1-13 characters of [A-Za-z0-9_-] (interface names are limited to"
                f" 15 and get a 2-character suffix), got {name!r}"
            )
        if not 0 <= subnet_octet <= 255:
            raise ValueError(f"subnet_octet must be 0-255, got {subnet_octet!r}")
        self._name = name
        self._octet = subnet_octet
        self._spec: LinkSpec = UNTHROTTLED
        self._created = False

    # ------------------------------------------------------------------ names and addresses

    @property
    def netns(self) -> str:
        return self._name

    @property
    def host_device(self) -> str:
        return f"{self._name}-h"

    @property
    def ns_device(self) -> str:
        return f"{self._name}-n"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.{self._octet}.0.0/24")

    @property
    def host_addr(self) -> str:
        return f"10.{self._octet}.0.1"

    @property
    def ns_addr(self) -> str:
        return f"10.{self._octet}.0.2"

    @property
    def spec(self) -> LinkSpec:
        """The shaping last applied by ``set_rate`` (unthrottled after ``create``)."""
        return self._spec

    @property
    def created(self) -> bool:
        return self._created

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the netns (as root, same filesystem and environment)."""
        return ["ip", "netns", "exec", self._name, *argv]

    def __repr__(self) -> str:
        return (
            f"ThrottledLink(netns={self._name!r}, {self.host_device} {self.host_addr} <-> "
            f"{self.ns_device} {self.ns_addr}, spec={self._spec}, created={self._created})"
        )

    # ------------------------------------------------------------------ lifecycle

    def create(self) -> ThrottledLink:
        """Build netns + veth pair (after removing leftovers of the same name); unthrottled."""
        self._cleanup()
        self._check_subnet_free()
        ns, h, n = self._name, self.host_device, self.ns_device
        try:
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "add", h, "type", "veth", "peer", "name", n, "netns", ns])
            _run(["ip", "addr", "add", f"{self.host_addr}/24", "dev", h])
            _run(["ip", "link", "set", h, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.ns_addr}/24", "dev", n])
            _run(["ip", "-n", ns, "link", "set", n, "up"])
            # The root shaper goes in now, while no traffic can make the graft wait (module doc).
            for side, dev in (("h", h), ("n", n)):
                _run([*self._tc(side), "qdisc", "add", "dev", dev, "root", "handle", ROOT_HANDLE,
                      *_tbf_args(OPEN_RATE_MBIT)])
        except BaseException:
            self._cleanup()
            raise
        self._created = True
        self._spec = UNTHROTTLED
        return self

    @classmethod
    def attach(cls, name: str = "pdtb", subnet_octet: int = 231) -> ThrottledLink:
        """A handle on a link another process created (e.g. ``pdserve dev --link-mbit``).

        Checks that the netns and ``<name>-h`` exist and reads the current shaping from ``tc``, so
        ``set_rate`` and ``measure_mbit`` work on it. The creator still owns the link: an attached
        handle should not ``destroy`` it (it can; cleanup is idempotent either way).
        """
        link = cls(name, subnet_octet)
        if not link._netns_exists():
            raise TestbedError(f"no netns {name!r} to attach to (`ip netns list`)")
        if not link._link_exists(link.host_device):
            raise TestbedError(f"netns {name!r} exists but {link.host_device} does not")
        link._created = True
        link._spec = _parse_spec(
            _run(["tc", "qdisc", "show", "dev", link.host_device, "root"]).stdout
        )
        return link

    def destroy(self) -> None:
        """Delete the veth pair and the netns. Idempotent; never kills processes (warns instead)."""
        self._created = False
        self._spec = UNTHROTTLED
        self._cleanup()

    def __enter__(self) -> ThrottledLink:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def _cleanup(self) -> None:
        ns, h = self._name, self.host_device
        if self._netns_exists():
            pids = _run(["ip", "netns", "pids", ns], ok_if=_GONE_MARKERS).stdout.split()
            if pids:
                warnings.warn(
                    f"processes {', '.join(pids)} are still inside netns {ns!r}; it lingers "
                    f"(detached, without its link) until they exit",
                    RuntimeWarning,
                    stacklevel=3,
                )
        # Deleting the root end destroys both ends of the pair even if the netns lingers.
        if self._link_exists(h):
            _run(["ip", "link", "del", h], ok_if=_GONE_MARKERS)
        if self._netns_exists():
            _run(["ip", "netns", "del", ns], ok_if=_GONE_MARKERS)

    def _netns_exists(self) -> bool:
        out = _run(["ip", "netns", "list"]).stdout
        return any(line.split()[0] == self._name for line in out.splitlines() if line.strip())

    @staticmethod
    def _link_exists(dev: str) -> bool:
        proc = _run(["ip", "-o", "link", "show", "dev", dev], ok_if=_GONE_MARKERS)
        return proc.returncode == 0

    def _check_subnet_free(self) -> None:
        """Refuse to create if some other interface or route in the root ns claims our subnet."""
        net = self.subnet
        addrs = _run(["ip", "-4", "-o", "addr", "show"]).stdout
        for line in addrs.splitlines():
            parts = line.split()
            if "inet" not in parts:
                continue
            iface = ipaddress.IPv4Interface(parts[parts.index("inet") + 1])
            if iface.network.overlaps(net):
                raise TestbedError(
                    f"{iface} on {parts[1]} overlaps {net}; pick another subnet_octet"
                )
        routes = _run(["ip", "-4", "route", "show"]).stdout
        route_types = {"unicast", "unreachable", "blackhole", "prohibit", "local", "broadcast",
                       "throw", "nat", "anycast", "multicast"}
        for line in routes.splitlines():
            words = line.split()
            if words and words[0] in route_types:
                words = words[1:]
            dst = words[0] if words else ""
            if not dst[:1].isdigit():  # "default" and anything that is not a prefix
                continue
            try:
                rnet = ipaddress.IPv4Network(dst, strict=False)
            except ValueError:
                continue
            if rnet.prefixlen > 0 and rnet.overlaps(net):
                raise TestbedError(
                    f"route `{line.strip()}` overlaps {net}; pick another subnet_octet"
                )

    # ------------------------------------------------------------------ shaping

    def _tc(self, side: str) -> list[str]:
        return ["tc"] if side == "h" else ["tc", "-n", self._name]

    def set_rate(self, spec: LinkSpec) -> None:
        """Apply, change or remove shaping on both directions (no recreation, no reconnects).

        A rate change (``LinkSpec(None)`` included) only changes the root tbf's parameters; the
        result is read back from both ends and must show ``spec``, else TestbedError, with
        ``spec`` left as what ``tc`` shows. Nothing is ever "restored" on failure: that is how
        a link once stayed throttled after a timed-out removal (module doc).

        ``delay_ms > 0`` needs the kernel's netem qdisc, which replaces the tbf (a graft, which
        may wait on RTNL while traffic flows); kernels without netem (the Firecracker kernels this
        project is tested on: no CONFIG_NET_SCH_NETEM) raise TestbedError and keep the shaping
        as it was, since the kernel refuses the qdisc before touching the device.
        """
        if not self._created:
            raise TestbedError(f"set_rate({spec}) on {self._name!r} before create()")
        try:
            self._apply(spec)
        except TestbedError as e:
            self._spec = self.read_spec()
            if spec.delay_ms > 0 and "qdisc kind is unknown" in str(e):
                raise TestbedError(
                    f"{e} -- this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so "
                    f"delay_ms={spec.delay_ms:g} cannot be emulated; only rate shaping (tbf) works"
                ) from e
            raise TestbedError(f"{e}; the link now reads {self._spec}") from e
        shown = self.read_spec()
        self._spec = shown if not _same(shown, spec) else spec
        if not _same(shown, spec):
            raise TestbedError(f"set_rate({spec}) on {self._name!r}: tc shows {shown}")

    def cut(self) -> None:
        """Drop every packet both ways, silently, as a partition between two hosts looks to
        each: nothing answers and nothing refuses (a connect times out, an open connection
        waits). A tbf no packet fits through (a 1-byte bucket), because this kernel has neither
        netem's loss nor a drop action. ``set_rate`` heals it."""
        if not self._created:
            raise TestbedError(f"cut() on {self._name!r} before create()")
        for side, dev in (("h", self.host_device), ("n", self.ns_device)):
            _run([*self._tc(side), "qdisc", "replace", "dev", dev, "root", "handle",
                  ROOT_HANDLE, "tbf", "rate", "8bit", "burst", "1", "limit", "1"])
        self._spec = self.read_spec()

    def read_spec(self) -> LinkSpec:
        """The shaping ``tc`` shows now on both ends (raises if the two ends disagree)."""
        specs = {_parse_spec(_run([*self._tc(side), "qdisc", "show", "dev", dev, "root"]).stdout)
                 for side, dev in (("h", self.host_device), ("n", self.ns_device))}
        if len(specs) != 1:
            raise TestbedError(f"the two ends of {self._name!r} are shaped differently: {specs}")
        return specs.pop()

    def _apply(self, spec: LinkSpec) -> None:
        for side, dev in (("h", self.host_device), ("n", self.ns_device)):
            tc = self._tc(side)
            if spec.delay_ms > 0:
                _run([*tc, "qdisc", "replace", "dev", dev, "root", *self._netem_args(spec)])
                continue
            tbf = ["dev", dev, "root", "handle", ROOT_HANDLE, *_tbf_args(
                spec.rate_mbit if spec.rate_mbit is not None else OPEN_RATE_MBIT)]
            if _root_kind(_run([*tc, "qdisc", "show", "dev", dev, "root"]).stdout) == "tbf":
                _run([*tc, "qdisc", "change", *tbf])
            else:  # netem before, or a link made without the root tbf: one graft, then in place
                _run([*tc, "qdisc", "replace", *tbf])

    @staticmethod
    def _netem_args(spec: LinkSpec) -> list[str]:
        # netem queue limit is in packets: enough for the bandwidth-delay product (plus 100 ms of
        # queueing) in MTU-sized packets, never below netem's default of 1000.
        rate_bps = (spec.rate_mbit or 10_000) * 1e6 / 8
        bdp_pkts = int(rate_bps * (spec.delay_ms / 1000 + 0.1) / 1500) + 1
        args = ["netem", "delay", f"{spec.delay_ms:g}ms", "limit", str(max(1000, 2 * bdp_pkts))]
        if spec.rate_mbit is not None:
            args += ["rate", f"{spec.rate_mbit:g}mbit"]
        return args

    def qdiscs(self) -> dict[str, str]:
        """``tc qdisc show`` for each end (for diagnostics and tests)."""
        return {
            self.host_device: _run(["tc", "qdisc", "show", "dev", self.host_device]).stdout.strip(),
            self.ns_device: _run(
                ["tc", "-n", self._name, "qdisc", "show", "dev", self.ns_device]
            ).stdout.strip(),
        }


# ---------------------------------------------------------------------- measurement

# The receiving end: accept one connection, read to EOF, print what arrived and how long it took
# from the first byte to the last (the first chunk is not counted: it left in no time).
_SINK = r"""
import json, socket, sys, time
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], 0))
srv.listen(1)
srv.settimeout(float(sys.argv[2]))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.settimeout(float(sys.argv[2]))
buf = bytearray(1 << 20)
first = conn.recv_into(buf)
t0 = time.monotonic()
t1 = t0
n = 0
while True:
    k = conn.recv_into(buf)
    if not k:
        break
    n += k
    t1 = time.monotonic()
conn.close()
print(json.dumps({"first": first, "bytes": n, "elapsed": t1 - t0}), flush=True)
"""

# The sending end when it has to run inside the netns (reverse direction).
_SOURCE = r"""
import socket, sys
host, port, nbytes, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
chunk = memoryview(bytes(1 << 20))
with socket.create_connection((host, port), timeout=timeout) as s:
    while nbytes > 0:
        k = min(nbytes, len(chunk))
        s.sendall(chunk[:k])
        nbytes -= k
    s.shutdown(socket.SHUT_WR)
"""


def _default_nbytes(spec: LinkSpec) -> int:
    """About 2 s of data at the configured rate, within [256 KiB, 256 MiB]."""
    if spec.rate_mbit is None:
        return 256 << 20
    return int(min(256 << 20, max(256 << 10, spec.rate_mbit * 1e6 / 8 * 2.0)))


def _send(host: str, port: int, nbytes: int, deadline: float) -> None:
    chunk = memoryview(bytes(1 << 20))
    with socket.create_connection((host, port), timeout=max(1.0, deadline - time.monotonic())) as s:
        left = nbytes
        while left > 0:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            k = min(left, len(chunk))
            s.sendall(chunk[:k])
            left -= k
        s.shutdown(socket.SHUT_WR)


def _diagnose(link: ThrottledLink) -> str:
    """qdisc counters and TCP socket state on both ends, for error messages (best effort)."""
    parts = []
    for label, argv in (
        ("root qdisc", ["tc", "-s", "qdisc", "show", "dev", link.host_device]),
        ("netns qdisc", ["tc", "-n", link.netns, "-s", "qdisc", "show", "dev", link.ns_device]),
        ("root sockets", ["ss", "-tin", "dst", link.ns_addr]),
        ("netns sockets", ["ip", "netns", "exec", link.netns, "ss", "-tin", "dst", link.host_addr]),
    ):
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError) as e:
            out = repr(e)
        parts.append(f"[{label}] " + " ".join(out.split()))
    return " ".join(parts)


def measure_mbit(
    link: ThrottledLink,
    nbytes: int | None = None,
    timeout_s: float = 30.0,
    reverse: bool = False,
) -> float:
    """Measured TCP goodput across the link in Mbit/s (payload bytes, timed at the receiver).

    Default direction: root namespace -> netns (a sink runs inside the netns via
    ``ip netns exec``, this process sends). ``reverse=True``: netns -> root namespace, the
    direction KV blocks travel when the decode side pulls from a prefill engine in the netns
    (the sink runs here, bound to ``host_addr``; the sender runs inside the netns).
    ``nbytes`` defaults to ~2 s worth at ``link.spec`` (256 MiB unthrottled), so a 1 Mbit/s
    measurement moves 2 s of data (plus starting one or two Python processes). ``timeout_s``
    bounds the sink's start-up and, separately, the transfer. Payload goodput reads ~4-5 % under
    a tbf rate (Ethernet/IP/TCP headers are charged to the link).
    """
    if not link.created:
        raise TestbedError(f"measure_mbit on {link.netns!r} before create()")
    if nbytes is None:
        nbytes = _default_nbytes(link.spec)
    if nbytes < 64 << 10:
        raise ValueError(f"nbytes must be >= 64 KiB for a meaningful measurement, got {nbytes}")
    sink_host = link.host_addr if reverse else link.ns_addr
    sink_argv = [sys.executable, "-c", _SINK, sink_host, f"{timeout_s:g}"]
    if not reverse:
        sink_argv = link.wrap(sink_argv)
    procs: list[subprocess.Popen] = []
    what = (
        f"measuring {'netns -> root' if reverse else 'root -> netns'} "
        f"({sink_host}, {nbytes} bytes, {link.spec})"
    )
    try:
        sink = subprocess.Popen(
            sink_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            text=True,
        )
        procs.append(sink)
        # Process start-up is not part of the transfer's budget: on this 2-core box, with engines
        # busy, starting a Python process has taken many seconds.
        assert sink.stdout is not None
        ready, _, _ = select.select([sink.stdout], [], [], timeout_s)
        port_line = sink.stdout.readline() if ready else ""
        deadline = time.monotonic() + timeout_s
        if not port_line.strip().isdigit():
            sink.kill()
            _, err = sink.communicate(timeout=5)
            raise TestbedError(f"{what}: sink `{' '.join(sink_argv[:5])} ...` did not start: "
                               f"{err.strip()}")
        port = int(port_line)
        if reverse:
            source_argv = link.wrap([
                sys.executable, "-c", _SOURCE, sink_host, str(port), str(nbytes), f"{timeout_s:g}",
            ])
            source = subprocess.Popen(
                source_argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL, text=True,
            )
            procs.append(source)
            _, source_err = source.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if source.returncode != 0:
                raise TestbedError(f"{what}: sender in netns exited with {source.returncode}: "
                                   f"{source_err.strip()}")
        else:
            _send(sink_host, port, nbytes, deadline)
        out, err = sink.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TestbedError(f"{what} failed: {e!r}; link state: {_diagnose(link)}") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    if sink.returncode != 0:
        raise TestbedError(f"{what}: sink exited with {sink.returncode}: {err.strip()}")
    report = json.loads(out.strip().splitlines()[-1])
    if report["first"] + report["bytes"] != nbytes:
        raise TestbedError(f"{what}: sink received {report['first'] + report['bytes']} bytes")
    if report["elapsed"] <= 0:
        raise TestbedError(f"{what}: sink measured no time: {report}")
    return report["bytes"] * 8 / report["elapsed"] / 1e6
