"""Which UCX transports an engine's KV takes (issue 18, item 3): ``cma`` beside ``tcp`` by
default, so UCX reaches a same-node peer through shared memory and every other through tcp; only
``tcp`` over the throttled-link testbed (``cma`` would bypass the link it measures); a
``UCX_TLS`` in the launcher's environment wins everywhere."""

from __future__ import annotations

from dataclasses import dataclass

from launch.dev import DevOptions, engine_specs
from launch.engines import UCX_TLS, UCX_TLS_TCP, EngineSpec, engine_env
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
    on_node = engine_spec_for_node(t, "decode", 0, "10.0.0.7", [21006, 21007, 21008], "/m")
    assert engine_env(on_node, base={})["UCX_TLS"] == UCX_TLS
