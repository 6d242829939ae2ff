"""Which UCX transports an engine's KV takes (issue 18, item 3): ``cma`` beside ``tcp`` by
default, so UCX reaches a same-node peer through shared memory and every other through tcp; only
``tcp`` over the throttled-link testbed (``cma`` would bypass the link it measures); a
``UCX_TLS`` in the launcher's environment wins everywhere. On a GPU (reasoned, not run here: the
KV is device memory, which ``tcp``/``cma`` alone cannot read) UCX keeps every transport, and an
engine bound to its node's interface still names the node's RDMA ports."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from launch import engines
from launch.dev import DevOptions, engine_specs
from launch.engines import (
    UCX_TLS,
    UCX_TLS_GPU,
    UCX_TLS_GPU_TCP,
    UCX_TLS_TCP,
    EngineSpec,
    engine_env,
    rdma_ports,
)
from launch.ray_engine import EngineTemplate, engine_spec_for_node
from launch.settings import EngineSettings


@dataclass
class Link:
    """What ``engine_specs`` reads of a ``ThrottledLink`` (making one needs root)."""

    ns_addr: str = "10.231.0.2"
    netns: str = "pdtb"
    ns_device: str = "pdtb-ns"
    host_device: str = "pdtb-host"


def spec() -> EngineSpec:
    return EngineSpec(role="prefill", model="/m", served_model_name="m", port=1, side_channel_port=2)


def test_shared_memory_beside_tcp_by_default():
    assert UCX_TLS == "tcp,cma,self"
    assert engine_env(spec(), base={})["UCX_TLS"] == UCX_TLS


def test_the_launchers_own_setting_wins():
    assert engine_env(spec(), base={"UCX_TLS": "rc,tcp,self"})["UCX_TLS"] == "rc,tcp,self"


def test_dev_mode_uses_shared_memory_and_tcp_only_over_the_throttled_link():
    opts = DevOptions(model_path="/m", served_model_name="m")
    assert {engine_env(s, base={})["UCX_TLS"] for s in engine_specs(opts)} == {UCX_TLS}
    over_link = engine_specs(opts, link=Link())  # type: ignore[arg-type]
    assert {engine_env(s, base={})["UCX_TLS"] for s in over_link} == {UCX_TLS_TCP}


def test_ray_engines_use_shared_memory_and_tcp():
    t = EngineTemplate(model="tiny", served_model_name="pdserve-tiny",
                       engines=EngineSettings(kv_cache_gib=1))
    on_node = engine_spec_for_node(t, "decode", "10.0.0.7", [21006, 21007, 21008], "/m")
    assert engine_env(on_node, base={})["UCX_TLS"] == UCX_TLS


def test_a_gpu_engine_keeps_every_ucx_transport_and_tcp_only_over_the_testbed(monkeypatch):
    gpu = replace(spec(), device="cuda")
    assert UCX_TLS_GPU == "all" and engine_env(gpu, base={})["UCX_TLS"] == "all"
    assert engine_env(gpu, base={"UCX_TLS": "rc,cuda_ipc"})["UCX_TLS"] == "rc,cuda_ipc"
    monkeypatch.setattr("launch.dev.detect_device", lambda: "cuda")
    opts = DevOptions(model_path="/m", served_model_name="m")
    over_link = engine_specs(opts, link=Link())  # type: ignore[arg-type]
    assert {engine_env(s, base={})["UCX_TLS"] for s in over_link} == {UCX_TLS_GPU_TCP}


def fake_rdma(root: Path, ports: dict[str, list[str]]) -> str:
    for dev, numbers in ports.items():
        for n in numbers:
            (root / dev / "ports" / n).mkdir(parents=True)
    return str(root)


def test_rdma_ports_are_named_as_ucx_names_them(tmp_path):
    assert rdma_ports(fake_rdma(tmp_path, {"mlx5_1": ["1"], "mlx5_0": ["1", "2"]})) == [
        "mlx5_0:1", "mlx5_0:2", "mlx5_1:1"]
    assert rdma_ports(str(tmp_path / "none")) == []


@pytest.mark.parametrize("device, tls, want", [
    ("cuda", None, "eth1,mlx5_0:1"),  # every transport: RDMA too
    ("cuda", "tcp,cuda_copy,self", "eth1"),  # tcp only (a link being measured)
    ("cpu", None, "eth1"),  # host transports: no RDMA listed
])
def test_an_engine_bound_to_its_interface_still_names_the_rdma_ports(tmp_path, monkeypatch,
                                                                      device, tls, want):
    monkeypatch.setattr(engines, "RDMA_SYSFS", fake_rdma(tmp_path, {"mlx5_0": ["1"]}))
    bound = replace(spec(), device=device, ucx_device="eth1", ucx_tls=tls)
    assert engine_env(bound, base={})["UCX_NET_DEVICES"] == want
