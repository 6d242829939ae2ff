"""The KV connector configuration each engine role gets, generated in one place.

Both roles run vLLM's MultiConnector so further children (the CPU offload tier) slot in without
changing how engines are started. Today its child is NixlConnector: the prefill engine is the KV
producer, the decode engine the consumer. The same dict goes to ``--kv-transfer-config``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["prefill", "decode"]
LoadFailurePolicy = Literal["recompute", "fail"]

_KV_ROLE: dict[Role, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True)
class ConnectorOptions:
    """Knobs of the KV path that operators set; validated by ``launch`` before they get here.

    ``lease_s``: how long prefill holds blocks for a decode that has not read them yet (decode
    heartbeats extend it while the request queues). ``load_failure_policy``: what decode does when
    a pull fails — ``recompute`` keeps answers correct at the cost of time.
    """

    lease_s: int = 30
    load_failure_policy: LoadFailurePolicy = "recompute"
    backends: tuple[str, ...] = ("UCX",)
    #: CPU platform: use ``transport.nixl_cpu`` (progress thread that sleeps, compute thread
    #: kept on its own core). Off on GPU, where vLLM's connector is used as is.
    cpu_fixes: bool = False

    def __post_init__(self) -> None:
        if self.lease_s < 6:
            raise ValueError("lease_s must be >= 6 (heartbeats run every lease/6 s)")


def nixl_child(role: Role, options: ConnectorOptions) -> dict[str, Any]:
    child: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": _KV_ROLE[role],
        "kv_load_failure_policy": options.load_failure_policy,
        "kv_connector_extra_config": {
            "kv_lease_duration": options.lease_s,
            "backends": list(options.backends),
        },
    }
    if options.cpu_fixes:
        child["kv_connector_module_path"] = "transport.nixl_cpu"
        child["kv_connector_extra_config"].update(
            {"nixl_progress_delay_us": 1000, "restore_cpu_affinity": True}
        )
    return child


def kv_transfer_config(role: Role, options: ConnectorOptions | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value for an engine of ``role``."""
    options = options or ConnectorOptions()
    children = [nixl_child(role, options)]
    return {
        "kv_connector": "MultiConnector",
        "kv_role": _KV_ROLE[role],
        "kv_load_failure_policy": options.load_failure_policy,
        "kv_connector_extra_config": {
            "connectors": children,
            # The NIXL child reads these from its own extra config; MultiConnector-level copies
            # keep vLLM code that asks the top-level config consistent with the child.
            "kv_lease_duration": options.lease_s,
        },
    }


def kv_transfer_config_json(role: Role, options: ConnectorOptions | None = None) -> str:
    return json.dumps(kv_transfer_config(role, options), separators=(",", ":"))
