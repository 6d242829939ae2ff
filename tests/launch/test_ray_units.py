"""Ray mode's pure parts: port reservations, an engine's spec on its node, resources."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from launch.engines import private_socket_dir
from launch.ray_actors import (
    PLACEMENT_SHARE,
    actor_resources,
    placement_resource,
    resolve_accelerator,
    unplaceable,
)
from launch.ray_engine import EngineTemplate, PortReservation, engine_spec_for_node, interface_of
from launch.ray_mode import otel_runtime_env
from launch.settings import EngineSettings
from tests.launch.ray_fakes import FakeActor, FakeActorClass

TEMPLATE = EngineTemplate(model="tiny", served_model_name="pdserve-tiny",
                          engines=EngineSettings(kv_cache_gib=1))


def test_reservations_never_overlap_and_skip_busy_ports(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    rng = (port, port + 40)
    a = PortReservation("127.0.0.1", 3, rng, tmp_path)
    b = PortReservation("127.0.0.1", 3, rng, tmp_path)
    assert port not in a.ports + b.ports  # listening already
    assert not set(a.ports) & set(b.ports)
    a.release()
    c = PortReservation("127.0.0.1", 3, rng, tmp_path)
    assert set(c.ports) == set(a.ports)  # released ports are reusable
    busy.close()


def test_reservation_is_held_by_another_process(tmp_path):
    """The lock is per process: a second process on the node cannot take held ports."""
    rng = (40100, 40110)
    held = PortReservation("127.0.0.1", 2, rng, tmp_path)
    code = ("from launch.ray_engine import PortReservation; from pathlib import Path; "
            f"print(PortReservation('127.0.0.1', 2, {rng}, Path({str(tmp_path)!r})).ports)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert not set(eval(out)) & set(held.ports)  # noqa: S307 - a list literal we printed


def test_engine_spec_on_a_node():
    t = EngineTemplate(model="tiny", served_model_name="pdserve-tiny",
                       engines=EngineSettings(kv_cache_gib=1))
    p = engine_spec_for_node(t, "prefill", "127.0.0.1", [21000, 21001, 21002], "/m", 0)
    d1 = engine_spec_for_node(t, "decode", "127.0.0.1", [21003, 21004, 21005], "/m", 1)
    assert (p.url, p.side_channel_port, p.kv_events_endpoint) == (
        "http://127.0.0.1:21000", 21001, f"ipc://{private_socket_dir()}/kv-events-21002")
    on_node = engine_spec_for_node(t, "decode", "10.0.0.7", [21006, 21007, 21008], "/m")
    assert (on_node.url, on_node.kv_events_endpoint) == ("http://10.0.0.7:21006",
                                                         "tcp://10.0.0.7:21008")
    assert p.role == "prefill" and d1.role == "decode" and p.kv_cache_gib == 1
    assert p.ucx_device == "lo" == interface_of("127.0.0.1")
    assert (p.cpu_cores, d1.cpu_cores) == ("0", "1")  # the cores their actors reserved
    assert p.connector.cpu_fixes and p.connector.lease_s == 30


def test_resources_and_accelerator():
    assert actor_resources("gpu") == {"num_gpus": 1, "num_cpus": 1}
    assert actor_resources("cpu") == {"num_cpus": 1}
    assert resolve_accelerator("auto", {"CPU": 8}) == "cpu"
    assert resolve_accelerator("auto", {"CPU": 8, "GPU": 4}) == "gpu"
    assert resolve_accelerator("cpu", {"GPU": 4}) == "cpu"


def test_otel_settings_reach_the_actors_only_when_tracing():
    environ = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "HOME": "/root"}
    on = EngineSettings(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")
    assert otel_runtime_env(environ, on) == {
        "env_vars": {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}}
    assert otel_runtime_env(environ, EngineSettings()) is None
    assert otel_runtime_env({"HOME": "/root"}, on) is None


def test_a_role_placed_by_a_resource_asks_for_a_share_of_it():
    assert actor_resources("cpu", "pd_prefill") == {
        "num_cpus": 1, "resources": {"pd_prefill": PLACEMENT_SHARE}}
    assert actor_resources("gpu", None) == {"num_gpus": 1, "num_cpus": 1}


def test_roles_whose_resource_no_node_offers_are_named():
    placement = {"prefill": ("pd_prefill",), "decode": ("pd_decode", "pd_decode_b")}
    assert unplaceable(placement, {"CPU": 4.0, "pd_prefill": 100.0, "pd_decode": 100.0}) == [
        ("decode", "pd_decode_b")]
    assert unplaceable(placement, {"pd_prefill": 1.0, "pd_decode": 1.0,
                                   "pd_decode_b": 1.0}) == []
    assert unplaceable({}, {}) == []


def test_a_roles_engines_take_its_resources_round_robin():
    """``--decode-on a,b``: decode-0 on a node offering a, decode-1 on one offering b, decode-2
    on a again (one decode engine per node, say)."""
    placement = {"decode": ("pd_a", "pd_b")}
    taken: list[str | None] = []
    for _ in range(3):
        taken.append(placement_resource(placement, "decode", taken))
    assert taken == ["pd_a", "pd_b", "pd_a"]
    assert placement_resource(placement, "prefill", []) is None
    # decode-1 (pd_b) scaled away: the next one goes to pd_b, not to pd_a again.
    assert placement_resource(placement, "decode", ["pd_a", "pd_a"]) == "pd_b"


def test_scale_down_then_up_keeps_one_engine_per_node(monkeypatch):
    """``--decode-on pd_a,pd_b``, 2 decode engines; ``scale decode 1`` removes decode-1
    (pd_b), ``scale decode 2`` makes decode-2: on pd_b, where decode-1 was, not pd_a."""
    import asyncio

    import ray

    from launch.ray_actors import RayScaler

    cls = FakeActorClass()
    monkeypatch.setattr(ray, "kill", lambda h, no_restart=True: None)
    monkeypatch.setattr("launch.ray_actors.engine_host_class", lambda max_restarts: cls)
    scaler = RayScaler("pdserve", TEMPLATE, "cpu", -1, {"decode": ("pd_a", "pd_b")})
    scaler.create("decode", 2)
    asyncio.run(scaler.remove(["decode-1"]))
    scaler.create("decode", 1)
    assert {n: list(cls.asked[n]) for n in scaler.handles} == {
        "decode-0": ["pd_a"], "decode-2": ["pd_b"]}


def test_the_cli_takes_a_resource_per_role():
    import argparse

    from launch.cli import _add_ray

    parser = argparse.ArgumentParser()
    _add_ray(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ray", "--prefill-on", "pd_prefill"])
    assert (args.prefill_on, args.decode_on) == ("pd_prefill", None)
    args = parser.parse_args(["ray", "--decode-on", "pd_a,pd_b"])
    assert args.decode_on == "pd_a,pd_b"


def _hub_cache(root, repo_id: str, config: dict) -> None:
    """The Hugging Face cache layout vLLM's download leaves: refs/main -> a snapshot."""
    import json

    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(config))


QWEN_LIKE = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "hidden_size": 3584}


def test_an_engine_of_a_hub_model_reports_its_kv_size_once_ready(tmp_path, monkeypatch):
    """A hub id (the GPU template's ``--model``) is no directory: the engine downloads it, and
    once ready its actor reads the config from the Hugging Face cache, so the proxy's 'auto'
    policy gets a KV size (it refused to start without one)."""
    import huggingface_hub.constants

    from launch.ray_engine import EngineHost, model_kv_bytes_per_token

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert model_kv_bytes_per_token("Org/Model-7B", "bfloat16") is None  # not downloaded yet
    host = object.__new__(EngineHost)
    host.name, host.role, host.failed, host.restarted = "decode-0", "decode", None, False
    host.node_ip, host.node_id, host.kv_bytes_per_token = "10.0.0.7", "n", None
    host._model_path = "Org/Model-7B"
    host.spec = engine_spec_for_node(TEMPLATE, "decode", "10.0.0.7", [1, 2, 3], "Org/Model-7B")

    class Proc:
        popen = type("P", (), {"pid": 1})()
        log_path = "/log"

        def healthy(self):
            return True

    host.proc = Proc()  # type: ignore[assignment]
    _hub_cache(tmp_path, "Org/Model-7B", QWEN_LIKE)  # what vLLM's download left
    dtype_bytes = 4 if host.spec.dtype == "float32" else 2
    assert host.info()["kv_bytes_per_token"] == 2 * 28 * 4 * 128 * dtype_bytes


def test_the_gpu_templates_model_is_sized_from_the_cache_its_engines_fill(tmp_path,
                                                                           monkeypatch):
    import re
    from pathlib import Path

    import huggingface_hub.constants

    from launch.ray_engine import model_kv_bytes_per_token

    yaml = (Path(__file__).resolve().parents[2] / "launch/cluster/gpu-aws.yaml").read_text()
    model = re.search(r"pdserve ray .*--model (\S+)", yaml).group(1)  # type: ignore[union-attr]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    _hub_cache(tmp_path, model, QWEN_LIKE)
    assert model_kv_bytes_per_token(model, "bfloat16") == 2 * 28 * 4 * 128 * 2


def test_auto_policy_without_a_kv_size_is_refused_with_what_to_do():
    from launch.ray_mode import deployment_kv_bytes_per_token

    infos = [{"kv_bytes_per_token": None}, {"kv_bytes_per_token": 4096}]
    assert deployment_kv_bytes_per_token(infos, "auto", "m") == 4096
    none = [{"kv_bytes_per_token": None}]
    assert deployment_kv_bytes_per_token(none, "disaggregate", "m") is None
    with pytest.raises(RuntimeError, match="--policy"):
        deployment_kv_bytes_per_token(none, "auto", "Org/Model")


def test_a_planted_lock_link_is_never_followed(tmp_path):
    """A link at a port's lock path (another user's doing, in a shared directory) is skipped,
    its target untouched: the lock files are opened without following links."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock_dir = tmp_path / "ports"
    lock_dir.mkdir()
    (lock_dir / "40300.lock").symlink_to(victim)
    r = PortReservation("127.0.0.1", 1, (40300, 40310), lock_dir)
    assert r.ports != [40300] and victim.read_text() == "precious\n"
    r.release()


def test_port_locks_and_engine_logs_are_this_users_alone(tmp_path):
    """By default the locks live in the private per-user directory (0700), not a shared
    ``/tmp`` one, each 0600; an engine log is opened the same way (no link followed)."""
    import os
    import stat

    from launch.processes import open_log

    r = PortReservation("127.0.0.1", 1, (40310, 40320))
    lock = private_socket_dir() / "ports" / f"{r.ports[0]}.lock"
    assert stat.S_IMODE(lock.lstat().st_mode) == 0o600
    assert stat.S_IMODE(lock.parent.lstat().st_mode) == 0o700
    r.release()
    assert EngineTemplate(model="m", served_model_name="m").log_dir is None  # private default
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "decode-21000.log").symlink_to(victim)
    with pytest.raises(OSError):
        open_log(tmp_path / "decode-21000.log", append=False)
    assert victim.read_text() == "precious\n"
    with open_log(tmp_path / "prefill-21000.log", append=False) as f:
        f.write(b"x")
    assert stat.S_IMODE(os.stat(tmp_path / "prefill-21000.log").st_mode) == 0o600


def test_engines_of_a_node_take_its_free_cores_first(tmp_path):
    """``--decode-on`` a 2-core node: its two decode engines (ordinals 0 and 1, or 0 and 2
    round robin) get a core each, whatever their roles and ordinals; a third shares the
    least taken core, and a core freed is taken again first."""
    from launch.ray_engine import CoreReservation

    a, b = CoreReservation([0, 1], tmp_path), CoreReservation([0, 1], tmp_path)
    assert (a.core, b.core) == (0, 1)
    c = CoreReservation([0, 1], tmp_path)  # more engines than cores: shares one
    a.release()
    d = CoreReservation([0, 1], tmp_path)
    assert (c.core, d.core) == (0, 0)  # core 0: c and d; core 1: b
    e = CoreReservation([0, 1], tmp_path)
    assert e.core == 1
    for r in (b, c, d, e):
        r.release()


def test_a_core_is_held_by_its_engines_process(tmp_path):
    code = ("from launch.ray_engine import CoreReservation; from pathlib import Path; "
            f"print(CoreReservation([0, 1], Path({str(tmp_path)!r})).core)")
    from launch.ray_engine import CoreReservation

    held = CoreReservation([0, 1], tmp_path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert (held.core, int(out)) == (0, 1)
    held.release()


class _Calls:
    """A fake actor handle whose ``info`` calls answer from a script (an exception is raised
    by ``ray.get``, as Ray does)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls = 0
        self.info = self

    def remote(self):
        self.calls += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def _fake_ray_get(monkeypatch):
    import ray

    import launch.ray_engine as ray_engine

    def get(answer, timeout=None):
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray_engine.time, "sleep", lambda s: None)


READY = {"name": "decode-0", "failed": None, "healthy": True, "log": "/log"}


def test_an_actor_whose_constructor_raised_is_reported_at_once(monkeypatch):
    """Ray never restarts an actor whose constructor raised (a port or log directory refused,
    the model missing on its node): its error is the answer, not 15 minutes of waiting."""
    from ray.exceptions import ActorDiedError

    from launch.ray_engine import wait_engines_ready

    _fake_ray_get(monkeypatch)
    died = ActorDiedError()
    died._actor_init_failed = True  # what Ray sets when the creation task raised
    handle = _Calls(died)
    with pytest.raises(RuntimeError, match="decode-0 died: The actor died"):
        wait_engines_ready({"decode-0": handle}, timeout_s=1.0)
    assert handle.calls == 1


def test_an_actor_ray_restarts_is_waited_for_and_one_dead_for_good_is_not(monkeypatch):
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from launch.ray_engine import wait_engines_ready

    _fake_ray_get(monkeypatch)
    restarting = _Calls(ActorDiedError(), ActorUnavailableError("restarting", None), READY)
    assert wait_engines_ready({"decode-0": restarting}, timeout_s=900) == [READY]
    with pytest.raises(RuntimeError, match="decode-0 died"):
        wait_engines_ready({"decode-0": _Calls(ActorDiedError())}, timeout_s=1.0)
    with pytest.raises(RuntimeError, match="not ready after"):
        wait_engines_ready({"decode-0": _Calls(ActorUnavailableError("x", None))}, timeout_s=0)


def test_the_scaler_neither_counts_nor_keeps_engines_dead_for_good(monkeypatch):
    """decode-0 died for good (its actor, or its engine before ever being ready), decode-2
    is restarting, decode-1 serves: ``pdserve scale decode 1`` must not keep decode-0 and
    remove the live one, and ``pdserve scale decode 3`` must add one for decode-0."""
    import asyncio

    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from launch.ray_actors import RayScaler

    killed = []
    monkeypatch.setattr(ray, "kill", lambda h, no_restart=True: killed.append(h))
    monkeypatch.setattr("launch.ray_actors.engine_host_class", lambda max_restarts: None)
    scaler = RayScaler("pdserve", TEMPLATE, "cpu", -1)
    up = {"failed": None}
    for role, answers in (("decode", [ActorDiedError(), up, ActorUnavailableError("r", None)]),
                          ("prefill", [{"failed": "engine exited with 1"}, up])):
        for i, answer in enumerate(answers):
            scaler.handles[f"{role}-{i}"] = FakeActor(answer)
    dead = [scaler.handles["prefill-0"], scaler.handles["decode-0"]]
    # An actor's first ActorDiedError may be the death Ray restarts it from; a second in a
    # row is final (``died_for_good``). A failed engine is final at once.
    assert asyncio.run(scaler.replicas("decode")) == ["decode-0", "decode-1", "decode-2"]
    assert killed == dead[:1]
    assert asyncio.run(scaler.replicas("decode")) == ["decode-1", "decode-2"]
    assert asyncio.run(scaler.replicas("prefill")) == ["prefill-1"]
    assert killed == dead and all(a.stopped for a in dead)
    assert sorted(scaler.handles) == ["decode-1", "decode-2", "prefill-1"]


def test_a_port_held_on_another_interface_is_not_reserved_for_a_node_address(tmp_path):
    """A node-address engine's KV-event publisher binds ``tcp://*:port``: a port listened on
    loopback only is free on the node address, yet that bind fails (the engine would die at
    start-up), so it is skipped."""
    node_ip = next((a for a in subprocess.run(["hostname", "-I"], capture_output=True,
                                                text=True).stdout.split()
                    if ":" not in a and not a.startswith("127.")), None)
    if node_ip is None:
        pytest.skip("no non-loopback IPv4 address")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    r = PortReservation(node_ip, 1, (port, port + 20), tmp_path)
    assert r.ports and port not in r.ports
    r.release()
    held.close()


def test_without_an_address_ray_mode_starts_a_cluster_of_its_own():
    """``pdserve ray`` without ``--address`` starts a local cluster: address None would join
    the one RAY_ADDRESS or an earlier ``ray start`` on this machine names (and Ray refuses
    the local cluster's resources there)."""
    from launch.ray_mode import RayOptions, ray_init_kwargs

    local = ray_init_kwargs(RayOptions(TEMPLATE, "/m", placement={"decode": ("pd_d",)}), {})
    assert local["address"] == "local" and local["resources"] == {"pd_d": 100.0}
    joined = ray_init_kwargs(RayOptions(TEMPLATE, "/m", address="auto"), {})
    assert joined["address"] == "auto" and joined["resources"] is None


def test_the_cluster_watchdog_reads_ipv6_gcs_addresses():
    """Ray writes an IPv6 GCS address bracketed; connecting to host ``[::1]`` failed every
    time and the watchdog stopped a healthy deployment."""
    from launch.ray_mode import split_address

    assert split_address("[::1]:6379") == ("::1", 6379)
    assert split_address("[fd00::7]:6379") == ("fd00::7", 6379)
    assert split_address("10.0.0.2:6379") == ("10.0.0.2", 6379)


@pytest.mark.parametrize(("argv", "sent"), [
    ([], {"role": "decode", "replicas": 1}),
    (["--drain-timeout-s", "0"], {"role": "decode", "replicas": 1, "drain_timeout_s": 0.0}),
    (["--drain-timeout-s", "5"], {"role": "decode", "replicas": 1, "drain_timeout_s": 5.0}),
])
def test_pdserve_scale_sends_the_drain_timeout_asked_for(monkeypatch, argv, sent):
    """``--drain-timeout-s 0`` was dropped, and the proxy drained for its default (600 s)
    instead of answering the 0 asked for."""
    import json
    import urllib.request

    from launch import cli

    bodies = []

    class Reply:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return b"{}"

    def urlopen(req, timeout=None):
        bodies.append(json.loads(req.data))
        return Reply()

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    assert cli.main(["scale", "decode", "1", *argv]) == 0
    assert bodies == [sent]
