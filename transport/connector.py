"""The KV connector configuration each engine role gets, generated in one place.

Both roles run vLLM's MultiConnector. Its first child is NixlConnector: the prefill engine is the
KV producer, the decode engine the consumer. With ``offload_tier_gib > 0`` a second child,
vLLM's OffloadingConnector (``kv_both``), copies the full blocks an engine computes into a
host-memory tier and loads them back on a later prefix hit that the engine's own KV pool has
already dropped: on the CPU platform through ``transport.cpu_offload``'s spec, on GPU through
vLLM's built-in ``CPUOffloadingSpec``. MultiConnector loads a request from the first child that
has tokens for it (a NIXL hand-off wins over the tier) and saves to every child. The same dict
goes to ``--kv-transfer-config``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

#: ``both``: an engine that prefills for others on some requests and pulls KV on others (vLLM's
#: ``kv_both``; its connector decides per request from ``kv_transfer_params``, and vLLM 0.32
#: logs the role as deprecated for NIXL without refusing it).
Role = Literal["prefill", "decode", "both"]
LoadFailurePolicy = Literal["recompute", "fail"]
EvictionPolicy = Literal["lru", "arc"]

_KV_ROLE: dict[Role, str] = {"prefill": "kv_producer", "decode": "kv_consumer",
                             "both": "kv_both"}
_MIN_OFFLOAD_TIER_BYTES = 2**20


@dataclass(frozen=True)
class ConnectorOptions:
    """Knobs of the KV path that operators set; validated by ``launch`` before they get here.

    ``lease_s``: how long prefill holds blocks for a decode that has not read them yet (decode
    heartbeats extend it while the request queues). ``load_failure_policy``: what decode does when
    a pull fails — ``recompute`` keeps answers correct at the cost of time.

    ``offload_tier_gib``: host memory for this engine's KV offload tier, 0 = no tier (the tier is
    per engine: a prefill and a decode engine with 4 GiB each take 8 GiB).
    ``offload_eviction_policy``: which chunk a full tier drops (vLLM's ``lru`` or ``arc``).
    ``offload_store_threshold``: a block is stored only once it was offered that many times
    (< 2: every block is stored).
    """

    lease_s: int = 30
    load_failure_policy: LoadFailurePolicy = "recompute"
    backends: tuple[str, ...] = ("UCX",)
    #: CPU platform: use ``transport.nixl_cpu`` (progress thread that sleeps, compute thread
    #: kept on its own core) and ``transport.cpu_offload``'s tier. Off on GPU, where vLLM's
    #: connectors are used as is.
    cpu_fixes: bool = False
    offload_tier_gib: float = 0
    offload_eviction_policy: EvictionPolicy = "lru"
    offload_store_threshold: int = 0
    #: GPU only: a file-system tier under the host tier (vLLM's TieringOffloadingSpec, "fs").
    offload_fs_dir: str | None = None

    def __post_init__(self) -> None:
        if self.lease_s < 6:
            raise ValueError("lease_s must be >= 6 (heartbeats run every lease/6 s)")
        gib = self.offload_tier_gib
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib):
            raise ValueError(f"offload_tier_gib must be a number of GiB, got {gib!r}")
        if gib != 0 and self.offload_tier_bytes < _MIN_OFFLOAD_TIER_BYTES:
            raise ValueError(f"offload_tier_gib must be 0 (no tier) or at least 1 MiB, got {gib!r}")
        if self.offload_eviction_policy not in get_args(EvictionPolicy):
            raise ValueError(
                f"offload_eviction_policy must be one of {get_args(EvictionPolicy)}, "
                f"got {self.offload_eviction_policy!r}"
            )
        if self.offload_fs_dir is not None:
            if self.cpu_fixes:
                raise ValueError(
                    "a file-system offload tier is not available on the CPU platform: vLLM 0.32's "
                    "TieringOffloadingSpec builds the CUDA worker and reads the host tier through "
                    "a shared-memory region the CPU worker does not use")
            if self.offload_tier_gib <= 0:
                raise ValueError("a file-system offload tier sits under the host tier: "
                                 "set offload_tier_gib too")
            if self.offload_store_threshold >= 2:
                raise ValueError("vLLM's tiering spec refuses store_threshold >= 2")
        threshold = self.offload_store_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"offload_store_threshold must be an int >= 0, got {threshold!r}")

    @property
    def offload_tier_bytes(self) -> int:
        return int(self.offload_tier_gib * 2**30)


def nixl_child(role: Role, options: ConnectorOptions) -> dict[str, Any]:
    child: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": _KV_ROLE[role],
        "kv_load_failure_policy": options.load_failure_policy,
        "kv_connector_extra_config": {
            "kv_lease_duration": options.lease_s,
            "backends": list(options.backends),
        },
        # vLLM's connector plus the hand-off read-by check (transport/nixl_lease.py).
        "kv_connector_module_path": "transport.nixl_lease",
    }
    if options.cpu_fixes:
        child["kv_connector_module_path"] = "transport.nixl_cpu"
        child["kv_connector_extra_config"].update(
            {"nixl_progress_delay_us": 1000, "restore_cpu_affinity": True}
        )
    return child


def offload_child(options: ConnectorOptions) -> dict[str, Any]:
    """vLLM's OffloadingConnector over a host tier of ``options.offload_tier_gib``, same on both
    roles: it stores blocks the engine computed and loads them back on a prefix hit."""
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": options.offload_tier_bytes,
        "eviction_policy": options.offload_eviction_policy,
        "store_threshold": options.offload_store_threshold,
    }
    if options.cpu_fixes:
        # vLLM's CPUOffloadingSpec refuses the CPU platform in get_worker; this subclass does not.
        extra.update(spec_name="HostTierOffloadingSpec", spec_module_path="transport.cpu_offload")
    elif options.offload_fs_dir is not None:
        extra["spec_name"] = "TieringOffloadingSpec"
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": options.offload_fs_dir}]
    else:
        extra["spec_name"] = "CPUOffloadingSpec"
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": options.load_failure_policy,
        "kv_connector_extra_config": extra,
    }


def kv_transfer_config(role: Role, options: ConnectorOptions | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value for an engine of ``role``."""
    options = options or ConnectorOptions()
    children = [nixl_child(role, options)]
    if options.offload_tier_gib > 0:
        children.append(offload_child(options))
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
