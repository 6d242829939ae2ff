"""`ray up` for real, on two nodes: the shipped on-premises cluster file, pointed at two SSH
servers this test runs, each a node of its own (``launch/ssh_node.py``: its own home, /tmp and
process table). The worker node is in a network namespace behind the testbed's veth link
(``launch/testbed.py``), the head on the link's host side. Ray's autoscaler, on the head,
starts the worker over SSH, and the worker runs pdserve's setup as shipped (``make setup`` into
its own ``~/pdserve-venv``, its pip reaching PyPI through ``launch/egress.py``; its image carries
a hard-linked copy of this machine's uv package cache, as a node image with a warm cache would,
so it unpacks no wheel twice: its setup took 96 s, not 145). The deployment
puts prefill on the worker and decode on the head, serves a chat completion P/D across the link
(the `openai` client; the decode engine's NIXL counts the pull), its greedy text equals the head
alone's, and `ray down` leaves nothing running on either node within 45 s (the worker's
``pdserve node-watch`` stops its Ray once the head's refuses connections: Ray's own timeouts
would take two minutes).

Adapted from launch/cluster/onprem.yaml only where this machine differs: the nodes' addresses,
their SSH port (via ``ssh_proxy_command``), each node's IP given to ``ray start`` (the worker's
namespace has no default route for Ray's address detection), the head's already-installed
environment instead of a fresh build, role resources per node, the tiny model and test ports.
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

import httpx
import psutil
import pytest
import yaml

from harness.routes import wait_for
from harness.stack import http_status
from launch import testbed
from launch.egress import EgressProxy
from launch.ssh_node import SshNode
from tests.e2e.test_zz_prefill_down import sample

REPO = Path(__file__).resolve().parents[2]
PROXY_PORT = 19500
BIN = Path(sys.executable).parent
NIXL_BYTES = 'vllm:nixl_bytes_transferred_sum{engine="0",model_name="pdserve-tiny"}'
#: How soon after `ray down` returns nothing of the deployment may run on either node.
LEFT_WITHIN_S = 45
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

_MISSING = [what for what, ok in (
    ("root", os.geteuid() == 0),
    ("sshd", shutil.which("sshd", path="/usr/sbin:/usr/bin")),
    ("rsync", shutil.which("rsync")),
    ("network namespaces", testbed.available())) if not ok]
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
def nodes(tmp_path):
    """The head (on the link's host side) and the worker (in the link's netns), each an SSH
    server for one key, as two machines; powered off and their files removed after."""
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    pub = Path(f"{key}.pub").read_text()
    # Not under /tmp: each node's /tmp is its own, bound over the machine's.
    root = Path("/var/tmp") / f"pdserve-ray-up-{os.getpid()}"
    ssh_port = free_port()
    link = testbed.ThrottledLink("pdrayup", 234)
    with link, EgressProxy(link.host_addr, free_port(), link.subnet) as egress:
        # The head runs this checkout's environment (BIN), which may be under /tmp (CI's clone).
        head = SshNode("head", link.host_addr, root / "head", pub, port=ssh_port,
                       keep=(REPO,) if Path("/tmp") in REPO.parents else ())
        # Port 22 in the worker's own netns: the head's autoscaler reaches it with plain SSH
        # (Ray keeps ssh_proxy_command for the launcher only).
        worker = SshNode("worker", link.ns_addr, root / "worker", pub, netns=link.netns,
                         port=22, egress=egress.url, package_cache=uv_cache())
        try:
            with head, worker:
                yield head, worker, key
        finally:
            shutil.rmtree(root, ignore_errors=True)


def uv_cache() -> Path | None:
    """This machine's uv package cache (``make setup`` filled it), if there is one."""
    uv = BIN / "uv"
    if not uv.exists():
        return None
    found = subprocess.run([str(uv), "cache", "dir"], capture_output=True, text=True)
    path = Path(found.stdout.strip())
    return path if found.returncode == 0 and path.is_dir() else None


def cluster_file(tmp_path: Path, head: SshNode, worker: SshNode, key: Path) -> Path:
    config = yaml.safe_load((REPO / "launch" / "cluster" / "onprem.yaml").read_text())
    gcs_port = free_port()
    config["cluster_name"] = f"pdserve-test-{os.getpid()}"
    config["provider"].update(head_ip=head.address, worker_ips=[worker.address])
    assert config["max_workers"] == 1
    config["auth"] = {
        "ssh_user": "root", "ssh_private_key": str(key),
        # The launcher reaches the head's sshd on its own port (Ray's SSH has no port option);
        # Ray does not pass this on to the head, whose autoscaler uses the worker's port 22.
        "ssh_proxy_command": (f"bash -c 'exec 3<>/dev/tcp/%h/{head.port}; "
                              "cat <&3 & exec cat >&3'"),
    }
    # The worker sets up as shipped; the head already has this machine's environment (BIN):
    # only the PATH step, pointed at it.
    shipped = config.pop("setup_commands")
    assert any("make -C ~/pdserve-src setup" in c for c in shipped), shipped
    config["setup_commands"] = []
    config["worker_setup_commands"] = shipped
    config["head_setup_commands"] = [c.replace("$HOME/pdserve-venv/bin", str(BIN))
                                     for c in shipped if "make " not in c]
    assert len(config["head_setup_commands"]) == 1
    start = [c.replace("--port=6379", f"--port={gcs_port} --num-cpus=4 --node-ip-address="
                       f"{head.address} --resources='{{\"pd_decode\": 100}}'")
             for c in config["head_start_ray_commands"]]
    start = [c.replace("--host 0.0.0.0 --port 8000",
                       f"--host 127.0.0.1 --port {PROXY_PORT} --model tiny --kv-blocks 512 "
                       "--policy disaggregate --probe-tokens '' "
                       "--prefill-on pd_prefill --decode-on pd_decode") for c in start]
    assert any(f"--port {PROXY_PORT}" in c for c in start), start
    config["head_start_ray_commands"] = start
    # After `ray down` the worker's Ray is stopped by the node's watch (launch/node_watch.py),
    # pointed at the head's GCS port here too.
    workers = [c.replace("$RAY_HEAD_IP:6379", f"$RAY_HEAD_IP:{gcs_port}")
               for c in config["worker_start_ray_commands"]]
    workers = [c.replace(f"$RAY_HEAD_IP:{gcs_port}", f"$RAY_HEAD_IP:{gcs_port} "
                         f"--node-ip-address={worker.address} "
                         f"--resources='{{\"pd_prefill\": 100}}'")
               if "ray start" in c else c for c in workers]
    assert any("pd_prefill" in c for c in workers), workers
    assert any(f"node-watch --address=$RAY_HEAD_IP:{gcs_port} " in c for c in workers), workers
    config["worker_start_ray_commands"] = workers
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


def cmdlines(pids: list[int]) -> list[str]:
    found = []
    for pid in pids:
        try:
            found.append(" ".join(psutil.Process(pid).cmdline())[:80])
        except psutil.Error:
            pass
    return found


def ray_cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def ray_down(path: Path) -> subprocess.CompletedProcess:
    """``ray down``, then the launcher's state and lock files removed (the cluster name is per
    test run). The head's autoscaler keeps its own state file in the head's /tmp: when the
    launcher and the head shared one /tmp, ``ray down``'s ``ray stop`` could kill the
    autoscaler while it rewrote the file, leaving it empty (a CI run saw it)."""
    from ray.autoscaler._private.local.config import get_lock_path, get_state_path

    name = yaml.safe_load(path.read_text())["cluster_name"]
    try:
        return ray_cli("down", "-y", str(path), timeout=300)
    finally:
        for leftover in (Path(get_state_path(name)), Path(get_lock_path(name))):
            leftover.unlink(missing_ok=True)


def chat() -> tuple[str, str]:
    """The question through the proxy with the `openai` client: (route, greedy answer)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{PROXY_PORT}/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(
        model="pdserve-tiny", max_tokens=8, temperature=0, messages=QUESTION)
    reply = raw.parse()
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
    return raw.headers["x-pd-route"], reply.choices[0].message.content


def test_two_node_ray_up_serves_pd_across_nodes_and_ray_down_cleans_up(nodes, tmp_path):
    head, worker, key = nodes
    assert not leftovers(), f"another Ray/pdserve is running here: {leftovers()}"
    path = cluster_file(tmp_path, head, worker, key)
    proxy = f"http://127.0.0.1:{PROXY_PORT}"
    start, phases = time.monotonic(), {}  # seconds from the start to each phase's end (-s)

    def phase(name: str) -> None:
        phases[name] = round(time.monotonic() - start)
        print(f"ray up test: {name} at {phases[name]} s", flush=True)

    up = ray_cli("up", "-y", "--no-config-cache", str(path), timeout=900)
    phase("ray up returned")
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        log = head.home / "pdserve.log"
        deadline = time.monotonic() + 900  # the worker's own `make setup` runs meanwhile
        while http_status(f"{proxy}/health") != 200:
            assert time.monotonic() < deadline, log.read_text()[-3000:] if log.exists() else ""
            time.sleep(2)
        phase("proxy healthy (worker set up, engines up)")
        # The worker set itself up as shipped, in its own home: the synced source, its venv.
        assert (worker.home / "pdserve-src" / "launch" / "cluster" / "onprem.yaml").exists()
        assert (worker.home / "pdserve-venv" / "bin" / "pdserve").exists()
        assert not (head.home / "pdserve-venv").exists()
        # Each node's Ray wrote in its own /tmp.
        # (session_latest links to /tmp/ray/...: the node's /tmp, not the test's)
        assert any((head.tmp / "ray").glob("session_2*"))
        assert any((worker.tmp / "ray").glob("session_2*"))
        engines = httpx.get(f"{proxy}/pd/costs", timeout=10).json()["engines"]
        hosts = {name: httpx.URL(e["url"]).host for name, e in engines.items()}
        assert hosts == {"prefill-0": worker.address, "decode-0": head.address}

        route, pd_text = chat()
        assert route == "disaggregated"
        # The KV crossed the link: the decode engine's NIXL read it from the worker node.
        # (vLLM publishes its connector's counters at its next stats interval)
        def nixl_lines() -> list[str]:
            text = httpx.get(engines["decode-0"]["url"] + "/metrics", timeout=10).text
            return [line for line in text.splitlines() if "nixl" in line and line[0] != "#"]

        try:
            wait_for(lambda: sample("\n".join(nixl_lines()), NIXL_BYTES) > 0,
                     "the decode engine's NIXL to count the pull", timeout_s=30)
        except AssertionError as e:
            raise AssertionError(f"{e}: {nixl_lines()}") from None
        # The head alone (its decode engine computes the prompt): the same greedy text.
        r = httpx.post(f"{proxy}/pd/admin/routing", json={"policy": "local"}, timeout=10)
        assert r.status_code == 200, r.text
        route, alone_text = chat()
        assert route == "local" and alone_text == pd_text
        phase("served")
    finally:
        down = ray_down(path)
        phase("ray down returned")
        # The worker's Ray goes within LEFT_WITHIN_S of `ray down` because its node watch
        # stops it; Ray's own timeouts (raylet 60 s, then its agents' last report to the
        # lost GCS, 60 s more) would keep it there longer.
        deadline = time.monotonic() + LEFT_WITHIN_S
        shown = 0.0
        while (leftovers() or worker.pids() or head.pids()) and time.monotonic() < deadline:
            if time.monotonic() - shown > 10:  # what it waits for (-s)
                shown = time.monotonic()
                print(f"ray up test: left {leftovers()} head {cmdlines(head.pids())} "
                      f"worker {cmdlines(worker.pids())}", flush=True)
            time.sleep(2)
        phase("nothing left running" if not leftovers() else "gave up waiting")
        left = leftovers()
        on_nodes = {"head": head.pids(), "worker": worker.pids()}
        for line in left:  # never leave them behind, even when the test is about to fail
            pid = int(line.split(":", 1)[0]) if line[0].isdigit() else None
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    assert not left, f"ray down left these running: {left}"
    assert not any(on_nodes.values()), f"ray down left processes on the nodes: {on_nodes}"
