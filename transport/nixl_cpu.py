"""vLLM's NixlConnector with two fixes for the CPU platform (``kv_connector_module_path``).

1. nixl 1.5.1's Python API builds every agent with ``pthrDelay = 0``, so the UCX backend's
   progress thread polls with a 0 ms timeout and spins: 45-95 % of a core per engine while idle,
   on the same core as the model's compute thread. Any delay >= 1 us makes it sleep in ``poll()``
   (rounded up to 1 ms) when nothing happens; UCX events still wake it at once.
2. vLLM's NIXL worker on the CPU platform "reserves the last core of each NUMA node" with
   ``os.sched_setaffinity(0, ...)``, which pins the worker's main thread - the model's compute
   thread - to the machine's last core whatever ``VLLM_CPU_OMP_THREADS_BIND`` said: two engines on
   one box then both compute on that core. The affinity is restored after the connector is built.

Measured side by side (benchmarks/ttft_breakdown.py --mode nixl-fix-ab, tiny model, 1.6k-token
prompts, 2-core box under load): p50 prefill time x0.13, direct P/D TTFT x0.12, hand-over x0.58
with both fixes. Keys in the NIXL child's ``kv_connector_extra_config``:
``nixl_progress_delay_us`` (int) and ``restore_cpu_affinity`` (bool). Otherwise
``transport/nixl_lease.py``'s connector (vLLM's, plus the hand-off read-by check).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from transport.nixl_lease import NixlConnector as _LeasedNixlConnector

DELAY_KEY = "nixl_progress_delay_us"
AFFINITY_KEY = "restore_cpu_affinity"
MODULE_PATH = __name__


def install_progress_delay(delay_us: int) -> None:
    """Make every NIXL agent created from now on in this process use ``delay_us``."""
    bindings = importlib.import_module("nixl._api").nixlBind
    real = getattr(bindings.nixlAgent, "_pdserve_real", bindings.nixlAgent)

    def make_agent(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return real(name, config)

    make_agent._pdserve_real = real  # type: ignore[attr-defined]
    bindings.nixlAgent = make_agent


class NixlConnector(_LeasedNixlConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        ktc = vllm_config.kv_transfer_config
        extra = (lambda key: ktc.get_from_extra_config(key, None)) if ktc else (lambda key: None)
        if (delay := extra(DELAY_KEY)) is not None and delay:
            install_progress_delay(int(delay))
        cpus = os.sched_getaffinity(0)
        super().__init__(vllm_config, role, kv_cache_config)
        if extra(AFFINITY_KEY) and os.sched_getaffinity(0) != cpus:
            os.sched_setaffinity(0, cpus)
