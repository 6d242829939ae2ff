"""transport/connector.py: the ``--kv-transfer-config`` each engine role gets."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from transport.connector import (
    ConnectorOptions,
    Role,
    kv_transfer_config,
    kv_transfer_config_json,
    nixl_child,
)


def only_child(config: dict[str, Any]) -> dict[str, Any]:
    children = config["kv_connector_extra_config"]["connectors"]
    assert len(children) == 1
    return children[0]


@pytest.mark.parametrize(
    ("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")]
)
def test_roles_map_on_multiconnector_and_nixl_child(role: Role, kv_role: str) -> None:
    config = kv_transfer_config(role)
    assert config["kv_connector"] == "MultiConnector"
    assert config["kv_role"] == kv_role
    child = only_child(config)
    assert child["kv_connector"] == "NixlConnector"
    assert child["kv_role"] == kv_role
    assert child == nixl_child(role, ConnectorOptions())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_defaults(role: Role) -> None:
    config = kv_transfer_config(role)
    assert config == kv_transfer_config(role, ConnectorOptions())
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"]["kv_lease_duration"] == 30
    child = only_child(config)
    assert child["kv_load_failure_policy"] == "recompute"
    assert child["kv_connector_extra_config"] == {"kv_lease_duration": 30, "backends": ["UCX"]}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_lease_failure_policy_and_backends_propagate(role: Role) -> None:
    options = ConnectorOptions(
        lease_s=45, load_failure_policy="fail", backends=("UCX", "LIBFABRIC")
    )
    config = kv_transfer_config(role, options)
    child = only_child(config)
    # MultiConnector level and NIXL child agree.
    assert config["kv_load_failure_policy"] == child["kv_load_failure_policy"] == "fail"
    assert config["kv_connector_extra_config"]["kv_lease_duration"] == 45
    assert child["kv_connector_extra_config"]["kv_lease_duration"] == 45
    assert child["kv_connector_extra_config"]["backends"] == ["UCX", "LIBFABRIC"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize(
    "options", [None, ConnectorOptions(), ConnectorOptions(lease_s=6, load_failure_policy="fail")]
)
def test_json_round_trip(role: Role, options: ConnectorOptions | None) -> None:
    text = kv_transfer_config_json(role, options)
    assert json.loads(text) == kv_transfer_config(role, options)
    assert " " not in text  # compact: one argv token, no shell quoting surprises


def test_configs_are_fresh_dicts() -> None:
    a = kv_transfer_config("prefill")
    a["kv_connector_extra_config"]["connectors"][0]["kv_role"] = "kv_consumer"
    assert only_child(kv_transfer_config("prefill"))["kv_role"] == "kv_producer"


@pytest.mark.parametrize("lease_s", [5, 1, 0, -30])
def test_short_lease_rejected(lease_s: int) -> None:
    with pytest.raises(ValueError, match="lease_s"):
        ConnectorOptions(lease_s=lease_s)


def test_minimum_lease_accepted() -> None:
    assert ConnectorOptions(lease_s=6).lease_s == 6


def test_options_are_frozen() -> None:
    options = ConnectorOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.lease_s = 1  # type: ignore[misc]


def test_cpu_fixes_load_pdserve_nixl_connector_on_the_nixl_child_only():
    from transport.connector import ConnectorOptions, kv_transfer_config

    cfg = kv_transfer_config("decode", ConnectorOptions(cpu_fixes=True))
    (child,) = cfg["kv_connector_extra_config"]["connectors"]
    assert child["kv_connector_module_path"] == "transport.nixl_cpu"
    assert child["kv_connector_extra_config"]["nixl_progress_delay_us"] > 0
    assert child["kv_connector_extra_config"]["restore_cpu_affinity"] is True
    assert "kv_connector_module_path" not in cfg
    plain = kv_transfer_config("decode", ConnectorOptions())
    (gpu_child,) = plain["kv_connector_extra_config"]["connectors"]
    assert gpu_child["kv_connector_module_path"] == "transport.nixl_lease"
    assert "nixl_progress_delay_us" not in gpu_child["kv_connector_extra_config"]


def test_both_connector_modules_load_and_check_the_read_by_time():
    import importlib

    from transport import nixl_lease

    for module in ("transport.nixl_lease", "transport.nixl_cpu"):
        cls = importlib.import_module(module).NixlConnector
        assert issubclass(cls, nixl_lease.NixlConnector)
        assert cls.on_new_request is nixl_lease.NixlConnector.on_new_request


def test_the_read_by_time_is_checked_on_arrival_not_when_scheduled(monkeypatch):
    """vLLM's scheduler tells the connector of a request when it arrives, and from then on
    its heartbeats keep the prefill's blocks; it asks for its KV only when a run slot is free,
    maybe long after. A hand-off that arrived in time is read however long it waited; a late
    one is dropped before vLLM registers heartbeats for it."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as Vllm

    from transport import kv_params, nixl_lease

    seen: list[dict] = []
    monkeypatch.setattr(Vllm, "on_new_request",
                        lambda self, request: seen.append(dict(request.kv_transfer_params)))
    monkeypatch.setattr(Vllm, "get_num_new_matched_tokens",
                        lambda self, request, n: (len(request.kv_transfer_params), False))
    connector = object.__new__(nixl_lease.NixlConnector)  # (no engine: the hooks only)
    now = 1000.0
    monkeypatch.setattr(nixl_lease.time, "time", lambda: now)

    def request(read_by: float) -> SimpleNamespace:
        return SimpleNamespace(request_id="r", kv_transfer_params={
            "do_remote_prefill": True, "remote_block_ids": [[1]], kv_params.READ_BY_KEY: read_by})

    waited = request(read_by=now + 5)
    connector.on_new_request(waited)  # arrived in time ...
    now += 60  # ... and waited a minute for a run slot
    connector.get_num_new_matched_tokens(waited, 0)
    assert waited.kv_transfer_params["do_remote_prefill"] is True
    late = request(read_by=now - 1)
    connector.on_new_request(late)
    assert seen[-1]["do_remote_prefill"] is False and "remote_block_ids" not in seen[-1]


def test_a_late_handoff_is_dropped_and_an_early_one_kept():
    # (the check the connector runs; the key names are kv_params' own)
    from transport import kv_params

    expire_if_late = kv_params.drop_late_handoff

    def params(read_by):
        p = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e"}
        if read_by is not None:
            p[kv_params.READ_BY_KEY] = read_by
        return p

    early = params(100.0)
    assert not expire_if_late(early, now=99.0)
    assert early["do_remote_prefill"] and early["remote_block_ids"] == [[1, 2]]
    assert kv_params.READ_BY_KEY not in early  # looked at once: later looks do nothing
    assert not expire_if_late(early, now=1000.0)
    late = params(100.0)
    assert expire_if_late(late, now=100.5)
    assert late["do_remote_prefill"] is False and "remote_block_ids" not in late
    no_deadline = params(None)
    assert not expire_if_late(no_deadline, now=1e12) and no_deadline["do_remote_prefill"]
    assert not expire_if_late(params("soon"), now=1e12)  # malformed: ignored, not a crash
    assert not expire_if_late(None, now=0.0)
    assert not expire_if_late({"do_remote_decode": True, kv_params.READ_BY_KEY: 1.0}, now=5.0)


def test_file_system_tier_on_gpu_and_refused_on_cpu():
    import pytest as _pytest

    from transport.connector import ConnectorOptions, kv_transfer_config

    gpu = ConnectorOptions(offload_tier_gib=4, offload_fs_dir="/mnt/kv")
    child = kv_transfer_config("decode", gpu)["kv_connector_extra_config"]["connectors"][1]
    extra = child["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert extra["secondary_tiers"] == [{"type": "fs", "root_dir": "/mnt/kv"}]
    with _pytest.raises(ValueError, match="CPU platform"):
        ConnectorOptions(cpu_fixes=True, offload_tier_gib=4, offload_fs_dir="/mnt/kv")
    with _pytest.raises(ValueError, match="under the host tier"):
        ConnectorOptions(offload_fs_dir="/mnt/kv")
    with _pytest.raises(ValueError, match="store_threshold"):
        ConnectorOptions(offload_tier_gib=4, offload_fs_dir="/mnt/kv", offload_store_threshold=2)
