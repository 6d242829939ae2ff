"""A host-memory KV tier for vLLM's OffloadingConnector on the CPU platform (loaded by name).

vLLM 0.32 splits offloading into *deciding* and *doing*. The deciding half, ``CPUOffloadingSpec``'s
sizing and its ``CPUOffloadingManager`` (lookup, LRU/ARC eviction, ``store_threshold``), runs in
the scheduler and is platform-independent. The doing half, ``CPUOffloadingWorker``, copies with
CUDA streams and DMA kernels, so ``CPUOffloadingSpec.get_worker`` refuses the CPU platform. There
the engine's KV cache already lives in host memory: offloading is a memcpy between its blocks and
a larger host tensor. ``HostTierOffloadingSpec`` keeps the parent's sizing and manager and swaps in
``HostTierWorker``, which does that memcpy.

Contract, as vLLM's ``OffloadingConnectorWorker`` drives it (one thread, the model runner's):
``submit_store`` / ``submit_load`` copy before returning, so a job is done when submitted;
``get_finished`` hands each job's ``TransferResult`` back once; ``wait`` has nothing to wait for.
Copies never fail quietly: vLLM's connector cannot report a failed job (it asserts success), so an
error propagates and fails the step.

Layout: the connector hands over ``CanonicalKVCaches``: per KV tensor an int8 ``(num_blocks, page)``
view of the engine's cache, and per KV cache group the refs (tensor index, unpadded page bytes)
of its layers. The tier keeps, per KV tensor, ``(num_chunks, blocks_per_chunk * page)`` int8: a
chunk is ``blocks_per_chunk`` engine blocks side by side. The engine side of a job is a
``GPULoadStoreSpec`` (block ids ordered by group, ``group_sizes``, ``block_indices``); the tier side
is the manager's ``CPULoadStoreSpec`` of chunk ids. A group's first block may start mid-chunk, at
sub-block ``block_indices[g] % blocks_per_chunk``, as in ``vllm/v1/kv_offload/cpu/gpu_worker.py``.

Config (the OffloadingConnector child's ``kv_connector_extra_config``, see ``transport.connector``):
``spec_name="HostTierOffloadingSpec"``, ``spec_module_path="transport.cpu_offload"``, and the
parent's keys: ``cpu_bytes_to_use``, ``eviction_policy``, ``store_threshold``.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from typing_extensions import override
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingManager,
    OffloadingWorker,
    OffloadKey,
    ReqContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

logger = logging.getLogger(__name__)


class HostTierOffloadingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` (sizing, manager) with a worker that runs on the CPU platform."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        if config.canonical_layout:
            raise ValueError(
                "HostTierOffloadingSpec stores each worker's pages as they are (direct layout); "
                "remove canonical_layout from kv_connector_extra_config"
            )
        if self.kv_bytes_per_chunk > 0 and self.num_chunks == 0:
            raise ValueError(
                f"cpu_bytes_to_use={self.extra_config['cpu_bytes_to_use']} holds no chunk of "
                f"{self.kv_bytes_per_chunk} bytes; give the offload tier more memory"
            )
        self._host_worker: HostTierWorker | None = None

    @override
    def get_manager(self) -> OffloadingManager:
        if not self._manager:
            self._manager = HostTierManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
            )
        return self._manager

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._host_worker is None:
            # num_chunks came from the scheduler's bytes-per-block estimate; the tier must not
            # outgrow cpu_bytes_to_use when the worker's tensors disagree with it.
            tier_bytes = (
                self.num_chunks
                * self.blocks_per_chunk
                * sum(t.page_size_bytes for t in kv_caches.tensors)
            )
            budget_bytes = int(self.extra_config["cpu_bytes_to_use"])
            if tier_bytes > budget_bytes:
                raise ValueError(
                    f"host KV tier needs {tier_bytes} bytes for {self.num_chunks} chunks, "
                    f"over cpu_bytes_to_use={budget_bytes}"
                )
            self._host_worker = HostTierWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._host_worker


class HostTierManager(CPUOffloadingManager):
    """vLLM's manager, plus the per-request tier filter (``kv_load_tiers`` in a request's
    ``kv_transfer_params``), which vLLM 0.32 applies only to its secondary tiers: a request that
    may not read the CPU tier finds nothing in it (and computes those tokens)."""

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not req_context.load_tier_filter.allows(Medium.CPU, Locality.LOCAL):
            return LookupResult.MISS
        return super().lookup(key, req_context)


class HostTierWorker(OffloadingWorker):
    """Copies KV blocks between the engine's host KV cache and a host tier, synchronously."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        if blocks_per_chunk < 1 or num_chunks < 1:
            raise ValueError(
                f"need blocks_per_chunk >= 1 and num_chunks >= 1, got "
                f"{blocks_per_chunk} and {num_chunks}"
            )
        self._blocks_per_chunk = blocks_per_chunk
        self._engine: list[torch.Tensor] = []  # per KV tensor: (num_blocks, page) int8 views
        self._tier: list[torch.Tensor] = []  # per KV tensor: (num_chunks, blocks_per_chunk, page)
        for kv in kv_caches.tensors:
            engine = kv.tensor.view(torch.int8).view(-1, kv.page_size_bytes)
            if engine.device.type != "cpu":
                raise ValueError(
                    f"HostTierWorker copies host memory; KV cache is on {engine.device}"
                )
            self._engine.append(engine)
            # zeros, not empty: commit the tier's memory at start-up, not under load.
            tier = torch.zeros(
                (num_chunks, blocks_per_chunk * kv.page_size_bytes), dtype=torch.int8
            )
            self._tier.append(tier.view(num_chunks, blocks_per_chunk, kv.page_size_bytes))
        # Per group: (tensor index, bytes to copy per block). Layers aliasing one tensor copy once.
        self._group_copies: list[list[tuple[int, int]]] = []
        for refs in kv_caches.group_data_refs:
            copy_bytes: dict[int, int] = {}
            for ref in refs:
                copy_bytes[ref.tensor_idx] = max(
                    copy_bytes.get(ref.tensor_idx, 0), ref.page_size_bytes
                )
            self._group_copies.append(sorted(copy_bytes.items()))
        self._finished: list[TransferResult] = []
        tier_bytes = sum(t.numel() for t in self._tier)
        logger.info(
            "host KV tier: %d chunks x %d blocks, %d tensors, %.2f GiB",
            num_chunks,
            blocks_per_chunk,
            len(self._tier),
            tier_bytes / 2**30,
        )

    @override
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Engine blocks -> tier chunks; done when this returns."""
        return self._run(job_id, src_spec, dst_spec, to_tier=True)

    @override
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Tier chunks -> engine blocks; done when this returns."""
        return self._run(job_id, dst_spec, src_spec, to_tier=False)

    @override
    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    @override
    def wait(self, job_ids: set[int]) -> None:
        return  # every submitted job has already completed

    @override
    def shutdown(self) -> None:
        self._engine.clear()
        self._tier.clear()
        self._finished.clear()

    def _run(
        self, job_id: int, engine_spec: LoadStoreSpec, tier_spec: LoadStoreSpec, to_tier: bool
    ) -> bool:
        assert isinstance(engine_spec, GPULoadStoreSpec)
        assert isinstance(tier_spec, BlockIDsLoadStoreSpec)
        start_s = time.perf_counter()
        num_bytes = self._copy(engine_spec, tier_spec.block_ids, to_tier)
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=num_bytes,
                transfer_time=time.perf_counter() - start_s,
            )
        )
        return True

    def _copy(self, engine_spec: GPULoadStoreSpec, chunk_ids: np.ndarray, to_tier: bool) -> int:
        """Copy every group's blocks; returns the bytes copied."""
        if len(engine_spec.group_sizes) != len(self._group_copies):
            raise ValueError(
                f"job has {len(engine_spec.group_sizes)} KV cache groups, "
                f"the tier {len(self._group_copies)}"
            )
        block_ids = engine_spec.block_ids
        block_offset = chunk_offset = num_bytes = 0
        for copies, group_size, block_index in zip(
            self._group_copies, engine_spec.group_sizes, engine_spec.block_indices
        ):
            if group_size == 0:
                continue
            skip = block_index % self._blocks_per_chunk
            num_chunks = cdiv(skip + group_size, self._blocks_per_chunk)
            blocks = torch.tensor(
                block_ids[block_offset : block_offset + group_size], dtype=torch.long
            )
            chunks, subs = self._tier_slots(
                chunk_ids[chunk_offset : chunk_offset + num_chunks], skip, group_size
            )
            for tensor_idx, page_bytes in copies:
                engine, tier = self._engine[tensor_idx], self._tier[tensor_idx]
                if to_tier:
                    tier[chunks, subs, :page_bytes] = engine[blocks, :page_bytes]
                else:
                    engine[blocks, :page_bytes] = tier[chunks, subs, :page_bytes]
                num_bytes += group_size * page_bytes
            block_offset += group_size
            chunk_offset += num_chunks
        if block_offset != len(block_ids) or chunk_offset != len(chunk_ids):
            raise ValueError(
                f"job covers {block_offset}/{len(block_ids)} blocks and "
                f"{chunk_offset}/{len(chunk_ids)} chunks"
            )
        return num_bytes

    def _tier_slots(
        self, chunk_ids: np.ndarray, skip: int, count: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(chunk, sub-block) of ``count`` consecutive blocks starting ``skip`` into the chunks."""
        slots = torch.tensor(chunk_ids, dtype=torch.long)[:, None] * self._blocks_per_chunk
        slots = (slots + torch.arange(self._blocks_per_chunk)).flatten()[skip : skip + count]
        if len(slots) != count:
            raise ValueError(
                f"{len(chunk_ids)} chunks hold no {count} blocks after skipping {skip}"
            )
        return slots // self._blocks_per_chunk, slots % self._blocks_per_chunk
