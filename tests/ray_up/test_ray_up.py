"""`ray up` for real: the shipped on-premises cluster file, pointed at an SSH server this test
runs on loopback; the cluster comes up, pdserve serves a chat completion through it (the
`openai` client), and `ray down` leaves nothing running.

Adapted from launch/cluster/onprem.yaml only where this machine differs: the head is 127.0.0.1
reached through the test's sshd (on its own port, via ``ssh_proxy_command``), no workers, the
already-installed environment instead of a fresh build, the tiny model and test ports.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from harness.stack import http_status

REPO = Path(__file__).resolve().parents[2]
PROXY_PORT = 19500
BIN = Path(sys.executable).parent

_MISSING = [what for what, ok in (
    ("root", os.geteuid() == 0),
    ("sshd", shutil.which("sshd", path="/usr/sbin:/usr/bin")),
    ("rsync", shutil.which("rsync"))) if not ok]
#: Skipped on a developer's machine without them; under CI (which installs them) a missing
#: prerequisite fails the test instead, so a broken install step cannot pass as a skip.
pytestmark = pytest.mark.skipif(
    bool(_MISSING) and os.environ.get("CI", "").lower() not in ("1", "true", "yes"),
    reason=f"needs {', '.join(_MISSING)} (.ci/run installs openssh-server and rsync)",
)


@pytest.fixture(autouse=True)
def _prerequisites():
    assert not _MISSING, f"CI=true but this machine lacks {', '.join(_MISSING)}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def bashrc():
    """The cluster's setup step appends to the SSH user's ~/.bashrc (here: this machine's
    root): put it back afterwards."""
    path = Path.home() / ".bashrc"
    saved = path.read_bytes() if path.exists() else None
    yield
    if saved is None:
        path.unlink(missing_ok=True)
    else:
        path.write_bytes(saved)


@pytest.fixture
def sshd(tmp_path):
    """An sshd on 127.0.0.1:<free port> accepting one key for root; stopped after."""
    key = tmp_path / "id_ed25519"
    host_key = tmp_path / "host_ed25519"
    for k in (key, host_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k)], check=True)
    (tmp_path / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    port = free_port()
    config = tmp_path / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\nPidFile {tmp_path}/sshd.pid\n"
        f"AuthorizedKeysFile {tmp_path}/authorized_keys\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        "StrictModes no\nAcceptEnv LANG LC_*\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    proc = subprocess.Popen([shutil.which("sshd", path="/usr/sbin:/usr/bin"), "-D", "-e", "-f",
                             str(config)], stderr=open(tmp_path / "sshd.log", "wb"))
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, (tmp_path / "sshd.log").read_text()
            assert time.monotonic() < deadline, "sshd did not start"
            time.sleep(0.2)
    yield key, port
    proc.terminate()
    proc.wait(10)


def cluster_file(tmp_path: Path, key: Path, ssh_port: int) -> Path:
    config = yaml.safe_load((REPO / "launch" / "cluster" / "onprem.yaml").read_text())
    gcs_port = free_port()
    config["cluster_name"] = f"pdserve-test-{os.getpid()}"
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    config["max_workers"] = 0
    config["auth"] = {
        "ssh_user": "root", "ssh_private_key": str(key),
        # The test's sshd listens on its own port; Ray's SSH has no port option.
        "ssh_proxy_command": (f"bash -c 'exec 3<>/dev/tcp/127.0.0.1/{ssh_port}; "
                              "cat <&3 & exec cat >&3'"),
    }
    config["file_mounts"] = {str(tmp_path / "pdserve-src"): "."}
    # This machine already has the environment (BIN): keep only the PATH step, pointed at it.
    config["setup_commands"] = [c.replace("$HOME/pdserve-venv/bin", str(BIN))
                                for c in config["setup_commands"] if "make " not in c]
    assert len(config["setup_commands"]) == 1 and str(BIN) in config["setup_commands"][0]
    start = [c.replace("--port=6379", f"--port={gcs_port} --num-cpus=4")
             for c in config["head_start_ray_commands"]]
    start = [c.replace("--host 0.0.0.0 --port 8000",
                       f"--host 127.0.0.1 --port {PROXY_PORT} --model tiny --kv-blocks 512 "
                       "--policy disaggregate --probe-tokens ''")
             .replace("~/pdserve.log", str(tmp_path / "pdserve.log")) for c in start]
    assert any(f"--port {PROXY_PORT}" in c for c in start), start
    config["head_start_ray_commands"] = start
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def leftovers() -> list[str]:
    """Ray, pdserve and vLLM processes still running, and the proxy port still open."""
    names = ("raylet", "gcs_server", "vllm.entrypoints.openai.api_server", "launch.cli ray",
             "pdserve ray", "VLLM::EngineCore", "ray::EngineHost")
    found = []
    for p in psutil.process_iter(["cmdline", "name", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
            continue
        cmd = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
        if any(n in cmd for n in names) and "pytest" not in cmd:
            found.append(f"{p.pid}: {cmd[:100]}")
    if http_status(f"http://127.0.0.1:{PROXY_PORT}/health") != 0:
        found.append(f"port {PROXY_PORT} still answers")
    return found


def ray_cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def ray_down(path: Path) -> subprocess.CompletedProcess:
    """``ray down``, once more if Ray's own state file was left empty by a race that exists
    only when the launcher and the head are one machine (as here): the launcher's cluster
    state file (``/tmp/ray/cluster-<name>.state``) is then also the head autoscaler's, and
    ``ray down``'s ``ray stop`` on the head can kill the autoscaler while it rewrites the file
    (open, truncate, write). ``ray down`` then fails reading it (a CI run saw it: 0 bytes,
    ``JSONDecodeError``). Without the file, Ray rebuilds it from the cluster file. Either
    way, the files are removed after (the cluster name is per test run)."""
    from ray.autoscaler._private.local.config import get_lock_path, get_state_path

    name = yaml.safe_load(path.read_text())["cluster_name"]
    state = Path(get_state_path(name))
    try:
        down = ray_cli("down", "-y", str(path), timeout=300)
        if (down.returncode != 0 and "JSONDecodeError" in down.stderr and state.exists()
                and state.stat().st_size == 0):
            print("ray down: Ray's cluster state file was left empty; again without it")
            state.unlink()
            down = ray_cli("down", "-y", str(path), timeout=300)
        return down
    finally:
        for leftover in (state, Path(get_lock_path(name))):
            leftover.unlink(missing_ok=True)


def test_ray_up_serves_and_ray_down_cleans_up(sshd, bashrc, tmp_path):
    from openai import OpenAI

    assert not leftovers(), f"another Ray/pdserve is running here: {leftovers()}"
    key, ssh_port = sshd
    path = cluster_file(tmp_path, key, ssh_port)
    up = ray_cli("up", "-y", "--no-config-cache", str(path), timeout=900)
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert (tmp_path / "pdserve-src" / "launch" / "cluster" / "onprem.yaml").exists()
        deadline = time.monotonic() + 600
        log = tmp_path / "pdserve.log"
        while http_status(f"http://127.0.0.1:{PROXY_PORT}/health") != 200:
            assert time.monotonic() < deadline, log.read_text()[-3000:] if log.exists() else ""
            time.sleep(2)
        client = OpenAI(base_url=f"http://127.0.0.1:{PROXY_PORT}/v1", api_key="unused")
        raw = client.chat.completions.with_raw_response.create(
            model="pdserve-tiny", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert raw.headers["x-pd-route"] == "disaggregated"
        reply = raw.parse()
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
    finally:
        down = ray_down(path)
        deadline = time.monotonic() + 180
        while leftovers() and time.monotonic() < deadline:
            time.sleep(2)
        left = leftovers()
        for line in left:  # never leave them behind, even when the test is about to fail
            pid = int(line.split(":", 1)[0]) if line[0].isdigit() else None
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    assert not left, f"ray down left these running: {left}"
