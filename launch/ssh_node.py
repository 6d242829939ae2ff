"""A node of its own on this machine, for ``ray up``: an SSH server in namespaces of its own, so
that what Ray's cluster launcher runs over SSH there sees a machine apart.

::

    root namespaces (the test, ray up)         the node: its own mount and PID namespaces,
                                               and its own netns when given one
    ssh -o ProxyCommand=... root@<address> --> sshd on <address>:<port>
                                                 ~      = <root>/home  (its own home: /etc/passwd
                                                                        is bound over, root's
                                                                        home field changed)
                                                 /tmp   = <root>/tmp   (Ray's temp dir with it)
                                                 ps     = this node's processes only

What it shares with the machine: the rest of the filesystem (the Python interpreter, make, rsync)
and the kernel. The PID namespace matters beyond tidiness: ``ray stop``, which Ray runs on every
node it starts and on the head at ``ray down``, kills Ray's processes by name, and without it one
node's ``ray stop`` would end the other's.

The node's home starts as a fresh machine's would (``/etc/skel``), plus the machine's image: the
head's Python first on PATH (Ray wants the same Python, patch level included, on every node),
and the user's pip configuration (where the machine's wheels are). ``egress`` (a proxy URL,
``launch/egress.py``) is given to the node's pip as ``PIP_PROXY``. ``package_cache`` (a uv cache
directory) is copied into the node's home, hard-linked, as a machine image with a warm package
cache would carry it: the node's setup still resolves, installs and byte-compiles everything
itself into its own venv, but unpacks no wheel the machine already unpacked (on this box that is
about 90 of the 145 s a cold ``make setup`` takes).

``stop`` ends the node the way power does: its first process (sshd) is killed, and the kernel
kills every other process in its PID namespace. ``pids`` lists them (host PIDs), sshd aside.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

START_TIMEOUT_S = 20.0
#: The machine's pip settings a node's image carries (this sandbox's PIP_FIND_LINKS, say).
_PIP_ENV = ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_CERT",
            "PIP_DEFAULT_TIMEOUT", "PIP_DISABLE_PIP_VERSION_CHECK", "PIP_CONSTRAINT")


class SshNode:
    """``with SshNode(name, address, root, authorized_key, netns=...) as node:`` sshd on
    ``address:port`` for root with ``authorized_key``, in a node of its own under ``root``
    (which must not be under /tmp: the node's /tmp is bound over it). ``keep``: paths the node
    must still see where they are although under /tmp (a checkout and its venv)."""

    def __init__(self, name: str, address: str, root: Path, authorized_key: str, *,
                 netns: str | None = None, port: int = 2222, egress: str | None = None,
                 keep: tuple[Path, ...] = (), package_cache: Path | None = None) -> None:
        root = Path(root).resolve()
        if root == Path("/tmp") or Path("/tmp") in root.parents:
            raise ValueError(f"a node's root cannot be under /tmp (its /tmp hides it): {root}")
        self.name, self.address, self.root, self.netns = name, address, root, netns
        self.port, self.egress, self._key = port, egress, authorized_key.strip()
        #: Paths of the machine the node still sees at their place, even under /tmp.
        self.keep = tuple(Path(k) for k in keep)
        self.package_cache = package_cache
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def log_path(self) -> Path:
        return self.root / "sshd.log"

    # ------------------------------------------------------------------ the node's image

    def _write_image(self) -> Path:
        etc = self.root / "etc"
        for d in (etc, self.home / ".ssh", self.home / ".config" / "pip", self.tmp):
            d.mkdir(parents=True, exist_ok=True)
        self.tmp.chmod(0o1777)
        for skel in Path("/etc/skel").glob(".*"):
            if skel.is_file():
                shutil.copy(skel, self.home / skel.name)
        python_bin = Path(sys.base_prefix) / "bin"
        bashrc = self.home / ".bashrc"
        body = bashrc.read_text() if bashrc.exists() else ""
        # First, before the rc file's "not interactive: return".
        bashrc.write_text(f'export PATH="{python_bin}:$PATH"\n{body}')
        user_pip = Path.home() / ".config" / "pip" / "pip.conf"
        if user_pip.exists():
            shutil.copy(user_pip, self.home / ".config" / "pip" / "pip.conf")
        (self.home / ".ssh" / "authorized_keys").write_text(self._key + "\n")
        if self.package_cache is not None:
            self._copy_package_cache(self.package_cache)
        passwd = []
        for line in Path("/etc/passwd").read_text().splitlines():
            f = line.split(":")
            if f[0] == "root":
                f[5] = str(self.home)
            passwd.append(":".join(f))
        (etc / "passwd").write_text("\n".join(passwd) + "\n")
        host_key = etc / "ssh_host_ed25519_key"
        if not host_key.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)],
                           check=True)
        env = {k: os.environ[k] for k in _PIP_ENV if k in os.environ}
        if self.egress:
            env["PIP_PROXY"] = self.egress
        set_env = ("SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()) + "\n") if env else ""
        config = etc / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress {self.address}\nHostKey {host_key}\n"
            f"PidFile {self.root}/sshd.pid\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            f"StrictModes no\nAcceptEnv LANG LC_*\n{set_env}")
        return config

    def _copy_package_cache(self, cache: Path) -> None:
        """``cache`` at the node's ``~/.cache/uv``, hard-linked (two seconds for 4 GB here); a
        copy that cannot be linked (another filesystem) is left out: the node then unpacks
        everything itself, as a fresh machine does."""
        target = self.home / ".cache" / "uv"
        target.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["cp", "-al", str(cache), str(target)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            shutil.rmtree(target, ignore_errors=True)
            log.warning("node %s: package cache %s not linked, the node unpacks its own: %s",
                        self.name, cache, done.stderr.strip()[-300:])

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> SshNode:
        config = self._write_image()
        sshd = shutil.which("sshd", path="/usr/sbin:/usr/bin")
        if sshd is None:
            raise RuntimeError("no sshd on this machine (Debian: openssh-server)")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        # ``keep`` paths under /tmp are held aside, then bound back at their place on top of
        # the node's own /tmp (the machine's software may live there: a CI checkout, say).
        held = [(Path(k).resolve(), self.root / "keep" / str(i)) for i, k in enumerate(self.keep)]
        aside = "".join(f"mkdir -p {spot} && mount --bind {path} {spot} && "
                        for path, spot in held)
        back = "".join(f"mkdir -p {path} && mount --bind {spot} {path} && "
                       for path, spot in held)
        inside = (f"mount --bind {self.root}/etc/passwd /etc/passwd && {aside}"
                  f"mount --bind {self.tmp} /tmp && {back}exec {sshd} -D -e -f {config}")
        argv = ["unshare", "--mount", "--pid", "--fork", "--mount-proc",
                "--propagation", "private", "sh", "-c", inside]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                      stderr=open(self.log_path, "wb"), start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"node {self.name}: sshd did not start: "
                                   f"{self.log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        log.info("node %s: sshd on %s:%d, home %s", self.name, self.address, self.port, self.home)
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.address, self.port), timeout=1) as s:
                return s.recv(4).startswith(b"SSH-")
        except OSError:
            return False

    def _init(self) -> psutil.Process | None:
        """The node's first process (sshd), seen from here: the child of ``unshare`` (which
        ``ip netns exec`` execs)."""
        if self._proc is None:
            return None
        try:
            children = psutil.Process(self._proc.pid).children()
        except psutil.NoSuchProcess:
            return None
        return children[0] if children else None

    def pids(self) -> list[int]:
        """Every live process of the node but its SSH server and sessions (host PIDs)."""
        init = self._init()
        if init is None:
            return []
        found = []
        for p in init.children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE and p.name() != "sshd":
                    found.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        return found

    def stop(self) -> None:
        """Power off: kill sshd, the node's PID 1; the kernel kills the rest."""
        init = self._init()
        if init is not None:
            try:
                init.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        if self._proc is not None:
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None

    def __enter__(self) -> SshNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

