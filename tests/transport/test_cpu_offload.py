"""transport/cpu_offload.py (the host KV tier's worker and spec) and the offload child of the
``--kv-transfer-config`` (transport/connector.py).

The worker is built the way an engine builds it: per-layer KV views laid out by vLLM's own
``create_kv_cache_views`` (LBHNC, the CPU attention backend's ``[blocks, heads, tokens, 2*head]``),
canonicalized by vLLM's ``OffloadingConnectorWorker.register_kv_caches``, which then calls our
spec's ``get_worker``. Jobs are the specs vLLM's offloading scheduler sends. No engine runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from transport.connector import ConnectorOptions, Role, kv_transfer_config, offload_child
from transport.cpu_offload import HostTierOffloadingSpec, HostTierWorker

NUM_BLOCKS = 8
TOKENS_PER_BLOCK = 32


@dataclass
class Engine:
    """One engine's host KV cache and the offload tier built over it."""

    raw: torch.Tensor  # the engine's KV allocation, as vLLM's CPU worker holds it
    layers: dict[str, torch.Tensor]  # per-layer views the attention backend reads
    spec: HostTierOffloadingSpec
    worker: HostTierWorker
    page_bytes: int

    def block(self, layer: str, block_id: int) -> torch.Tensor:
        return self.layers[layer][block_id].contiguous().view(torch.int8).clone()

    def scribble(self, seed: int) -> None:
        """Overwrite the whole KV cache: what the engine does when it reuses blocks."""
        fill_random(self.raw, seed)


def fill_random(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(-128, 128, t.shape, dtype=torch.int8, generator=g))


def attention_spec(dtype: torch.dtype = torch.bfloat16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=TOKENS_PER_BLOCK, num_kv_heads=2, head_size=32, dtype=dtype)


def offloading_config(
    groups: list[list[str]], bytes_per_block: int, blocks_per_chunk: int, extra: dict[str, Any]
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(TOKENS_PER_BLOCK, tuple(layers), group_id)
            for group_id, layers in enumerate(groups)
        ),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="engine-0",
        model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(
            tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=blocks_per_chunk
        ),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


#: What ``derive_canonical_mappings`` reads from the VllmConfig of a one-worker engine.
FAKE_VLLM_CONFIG = SimpleNamespace(
    parallel_config=SimpleNamespace(
        tensor_parallel_size=1,
        prefill_context_parallel_size=1,
        world_size=1,
        decode_context_parallel_size=1,
        cp_kv_cache_interleave_size=1,
        rank=0,
    ),
    model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2),
)


def start_engine(
    groups: list[list[str]] | None = None,
    blocks_per_chunk: int = 1,
    tier_chunks: int = 6,
    dtype: torch.dtype = torch.bfloat16,
    eviction_policy: str = "lru",
) -> Engine:
    groups = groups or [["layer.0", "layer.1", "layer.2"]]
    layer_names = [name for group in groups for name in group]
    spec = attention_spec(dtype)
    page = spec.page_size_bytes
    kv_tensor = KVCacheTensor(
        size=NUM_BLOCKS * page * len(layer_names),
        layers=layer_names,
        layer_stride=NUM_BLOCKS * page,
        block_stride=page,
    )
    raw = torch.empty(kv_tensor.size, dtype=torch.int8)
    fill_random(raw, seed=0)
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, KVCacheLayout.LBHNC, kv_tensor)
    layers = dict(zip(layer_names, views, strict=True))

    bytes_per_block = page * len(layer_names)
    assert bytes_per_block * blocks_per_chunk % 4096 == 0  # so the tier holds tier_chunks exactly
    config = offloading_config(
        groups,
        bytes_per_block,
        blocks_per_chunk,
        {
            "cpu_bytes_to_use": tier_chunks * bytes_per_block * blocks_per_chunk,
            "eviction_policy": eviction_policy,
        },
    )
    offload_spec = HostTierOffloadingSpec(config)
    assert offload_spec.num_chunks == tier_chunks
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[kv_tensor],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=g, kv_cache_spec=spec) for g in groups],
    )
    connector_worker = OffloadingConnectorWorker(offload_spec, FAKE_VLLM_CONFIG, kv_cache_config)
    connector_worker.register_kv_caches(layers)
    assert isinstance(connector_worker.worker, HostTierWorker)
    return Engine(raw, layers, offload_spec, connector_worker.worker, page)


def engine_spec(
    block_ids: list[int],
    group_sizes: list[int] | None = None,
    block_indices: list[int] | None = None,
) -> GPULoadStoreSpec:
    group_sizes = group_sizes or [len(block_ids)]
    return GPULoadStoreSpec(block_ids, group_sizes, block_indices or [0] * len(group_sizes))


def snapshot(
    engine: Engine, block_ids: list[int], layers: list[str] | None = None
) -> dict[tuple[str, int], torch.Tensor]:
    return {
        (layer, b): engine.block(layer, b) for layer in layers or engine.layers for b in block_ids
    }


def snapshot_subset(
    snap: dict[tuple[str, int], torch.Tensor], block_ids: list[int]
) -> dict[tuple[str, int], torch.Tensor]:
    return {key: value for key, value in snap.items() if key[1] in block_ids}


def assert_blocks_hold(
    engine: Engine,
    expected: dict[tuple[str, int], torch.Tensor],
    block_map: dict[int, int] | None = None,
) -> None:
    """Each (layer, old block) of ``expected`` is now in block ``block_map[old]`` of that layer."""
    for (layer, block_id), want in expected.items():
        got = engine.block(layer, (block_map or {}).get(block_id, block_id))
        assert torch.equal(got, want), f"{layer} block {block_id}"


# --- the worker -------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 4])
def test_store_overwrite_load_restores_blocks(blocks_per_chunk: int) -> None:
    engine = start_engine(blocks_per_chunk=blocks_per_chunk)
    request_blocks = [5, 2, 7, 1]
    chunks = [3, 0, 5, 4][: math.ceil(len(request_blocks) / blocks_per_chunk)]
    original = snapshot(engine, request_blocks)

    engine.worker.submit_store(1, engine_spec(request_blocks), CPULoadStoreSpec(chunks))
    engine.scribble(seed=1)
    assert not torch.equal(engine.block("layer.0", 5), original[("layer.0", 5)])
    engine.worker.submit_load(2, CPULoadStoreSpec(chunks), engine_spec(request_blocks))

    assert_blocks_hold(engine, original)


def test_load_into_other_blocks_leaves_the_rest_of_the_cache_alone() -> None:
    engine = start_engine(blocks_per_chunk=2)
    original = snapshot(engine, [0, 1, 2, 3])
    engine.worker.submit_store(1, engine_spec([0, 1, 2, 3]), CPULoadStoreSpec([2, 5]))
    engine.scribble(seed=1)
    bystanders = snapshot(engine, [0, 1, 2, 3])  # not destinations of the load

    engine.worker.submit_load(2, CPULoadStoreSpec([2, 5]), engine_spec([6, 4, 7, 5]))

    assert_blocks_hold(engine, original, block_map={0: 6, 1: 4, 2: 7, 3: 5})
    assert_blocks_hold(engine, bystanders)


def test_load_starting_mid_chunk() -> None:
    """A request whose first 2 blocks hit the engine's prefix cache loads blocks 2..7 only:
    the scheduler sends block_indices=[2] and the chunks from chunk 0, of which 2 are skipped."""
    engine = start_engine(blocks_per_chunk=4)
    request_blocks = list(range(NUM_BLOCKS))
    original = snapshot(engine, request_blocks)
    engine.worker.submit_store(1, engine_spec(request_blocks), CPULoadStoreSpec([4, 1]))
    engine.scribble(seed=1)

    new_blocks = [3, 0, 6, 1, 7, 2]  # for logical blocks 2..7
    engine.worker.submit_load(
        2, CPULoadStoreSpec([4, 1]), engine_spec(new_blocks, block_indices=[2])
    )

    assert_blocks_hold(
        engine,
        snapshot_subset(original, request_blocks[2:]),
        block_map=dict(zip(request_blocks[2:], new_blocks)),
    )


def test_store_starting_mid_chunk_fills_the_chunks_tail() -> None:
    """Logical blocks 1..3 of a request (block_indices=[1]) are sub-blocks 1..3 of chunk 0."""
    engine = start_engine(blocks_per_chunk=4)
    original = snapshot(engine, [4, 6, 2])
    engine.worker.submit_store(1, engine_spec([4, 6, 2], block_indices=[1]), CPULoadStoreSpec([0]))
    engine.scribble(seed=1)

    engine.worker.submit_load(2, CPULoadStoreSpec([0]), engine_spec([7, 0, 1, 3]))

    assert_blocks_hold(engine, original, block_map={4: 0, 6: 1, 2: 3})


def test_each_group_copies_its_own_layers() -> None:
    engine = start_engine(groups=[["full.0", "full.1"], ["other.0"]])
    first = snapshot(engine, [1, 2, 3], ["full.0", "full.1"])
    second = snapshot(engine, [6, 7], ["other.0"])
    spec = engine_spec([1, 2, 3, 6, 7], group_sizes=[3, 2])
    chunks = CPULoadStoreSpec([0, 1, 2, 3, 4])

    engine.worker.submit_store(1, spec, chunks)
    engine.scribble(seed=1)
    scribbled = engine.block("other.0", 1)
    engine.worker.submit_load(2, chunks, spec)

    assert_blocks_hold(engine, first | second)
    assert torch.equal(engine.block("other.0", 1), scribbled)  # not group 1's block


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
)
def test_round_trip_is_bytewise_for_every_kv_dtype(dtype: torch.dtype) -> None:
    engine = start_engine(dtype=dtype)
    original = snapshot(engine, [0, 3])
    engine.worker.submit_store(1, engine_spec([0, 3]), CPULoadStoreSpec([5, 4]))
    engine.scribble(seed=1)
    engine.worker.submit_load(2, CPULoadStoreSpec([5, 4]), engine_spec([0, 3]))
    assert_blocks_hold(engine, original)


def test_completion_is_reported_once_per_job() -> None:
    engine = start_engine(blocks_per_chunk=2)
    assert engine.worker.submit_store(7, engine_spec([0, 1, 2]), CPULoadStoreSpec([0, 1]))
    assert engine.worker.submit_load(8, CPULoadStoreSpec([0]), engine_spec([5, 6]))
    engine.worker.wait({7, 8})  # nothing left to wait for

    results = {r.job_id: r for r in engine.worker.get_finished()}

    assert set(results) == {7, 8}
    assert all(
        r.success and r.transfer_time is not None and r.transfer_time >= 0 for r in results.values()
    )
    assert results[7].transfer_size == 3 * len(engine.layers) * engine.page_bytes
    assert results[8].transfer_size == 2 * len(engine.layers) * engine.page_bytes
    assert engine.worker.get_finished() == []


def test_job_with_wrong_group_count_is_rejected() -> None:
    engine = start_engine()
    with pytest.raises(ValueError, match="KV cache groups"):
        engine.worker.submit_store(
            1, engine_spec([0, 1], group_sizes=[1, 1]), CPULoadStoreSpec([0, 1])
        )


def test_job_with_too_few_chunks_is_rejected() -> None:
    engine = start_engine(blocks_per_chunk=2)
    with pytest.raises(ValueError, match="chunks"):
        engine.worker.submit_store(1, engine_spec([0, 1, 2]), CPULoadStoreSpec([0]))


# --- the spec: vLLM's manager, our worker -----------------------------------------------------


@pytest.mark.parametrize("eviction_policy", ["lru", "arc"])
def test_vllm_manager_and_host_worker_round_trip(eviction_policy: str) -> None:
    engine = start_engine(tier_chunks=3, eviction_policy=eviction_policy)
    manager = engine.spec.get_manager()
    assert isinstance(manager, CPUOffloadingManager)
    keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(3)]
    request = ReqContext(req_id="r1")
    manager.on_new_request(request)
    original = snapshot(engine, [4, 5, 6])

    stored = manager.prepare_store(keys, request)
    assert stored is not None and stored.keys_to_store == keys
    engine.worker.submit_store(1, engine_spec([4, 5, 6]), stored.store_spec)
    assert [r.job_id for r in engine.worker.get_finished()] == [1]
    manager.complete_store(keys, request)
    assert all(manager.lookup(k, request) is LookupResult.HIT for k in keys)

    engine.scribble(seed=1)
    load_spec = manager.prepare_load(keys, request)
    engine.worker.submit_load(2, load_spec, engine_spec([0, 1, 2]))
    manager.complete_load(keys, request)

    assert_blocks_hold(engine, original, block_map={4: 0, 5: 1, 6: 2})


@pytest.mark.skipif(not current_platform.is_cpu(), reason="vLLM's worker runs on CUDA/XPU")
def test_vllm_cpu_spec_refuses_the_cpu_platform() -> None:
    """Why this module exists: vLLM's own worker path needs CUDA or XPU."""
    engine = start_engine()
    vllm_spec = CPUOffloadingSpec(engine.spec.config)
    with pytest.raises(Exception, match="only supported on CUDA-alike"):
        vllm_spec.get_worker(None)  # type: ignore[arg-type]


def test_spec_rejects_a_tier_without_room_for_one_chunk() -> None:
    config = offloading_config([["layer.0"]], 8192, 4, {"cpu_bytes_to_use": 8192})
    with pytest.raises(ValueError, match="holds no chunk"):
        HostTierOffloadingSpec(config)


def test_spec_refuses_a_tier_larger_than_its_budget() -> None:
    """Sized for 1 layer's bytes per block, handed 3 layers: 3x the memory asked for."""
    engine = start_engine()
    config = offloading_config(
        [list(engine.layers)], engine.page_bytes, 1, {"cpu_bytes_to_use": 2**20}
    )
    kv_caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(engine.raw[:8192].view(1, 8192), 8192)] * 3,
        group_data_refs=[[CanonicalKVCacheRef(i, 8192) for i in range(3)]],
    )
    with pytest.raises(ValueError, match="over cpu_bytes_to_use"):
        HostTierOffloadingSpec(config).get_worker(kv_caches)


def test_spec_rejects_canonical_layout() -> None:
    config = offloading_config([["layer.0"]], 8192, 1, {"cpu_bytes_to_use": 2**20})
    config = OffloadingConfig(**{**config.__dict__, "canonical_layout": True})
    with pytest.raises(ValueError, match="canonical_layout"):
        HostTierOffloadingSpec(config)


# --- the offload child of --kv-transfer-config --------------------------------------------------


def children(config: dict[str, Any]) -> list[dict[str, Any]]:
    return config["kv_connector_extra_config"]["connectors"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_no_tier_by_default(role: Role) -> None:
    assert [c["kv_connector"] for c in children(kv_transfer_config(role))] == ["NixlConnector"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_cpu_tier_child_follows_nixl_child(role: Role) -> None:
    options = ConnectorOptions(
        cpu_fixes=True,
        offload_tier_gib=4,
        offload_eviction_policy="arc",
        offload_store_threshold=2,
    )
    nixl, offload = children(kv_transfer_config(role, options))

    assert nixl["kv_connector"] == "NixlConnector"
    assert offload == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": 4 * 2**30,
            "eviction_policy": "arc",
            "store_threshold": 2,
            "spec_name": "HostTierOffloadingSpec",
            "spec_module_path": "transport.cpu_offload",
        },
    }
    spec_cls = OffloadingSpecFactory.get_spec_cls(offload["kv_connector_extra_config"])
    assert spec_cls is HostTierOffloadingSpec


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_gpu_tier_child_uses_vllms_spec(role: Role) -> None:
    options = ConnectorOptions(offload_tier_gib=0.5)
    _, offload = children(kv_transfer_config(role, options))
    extra = offload["kv_connector_extra_config"]
    assert extra == {
        "cpu_bytes_to_use": 2**29,
        "eviction_policy": "lru",
        "store_threshold": 0,
        "spec_name": "CPUOffloadingSpec",
    }
    assert OffloadingSpecFactory.get_spec_cls(extra) is CPUOffloadingSpec


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("cpu_fixes", [True, False])
def test_config_with_tier_is_valid_vllm_config(role: Role, cpu_fixes: bool) -> None:
    options = ConnectorOptions(cpu_fixes=cpu_fixes, offload_tier_gib=1)
    config = json.loads(json.dumps(kv_transfer_config(role, options)))
    top = KVTransferConfig(**config)
    assert top.kv_connector == "MultiConnector"
    for child in children(config):  # as MultiConnector builds each child's config
        KVTransferConfig(**child, engine_id=top.engine_id)
    assert offload_child(options) == children(config)[1]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_multiconnector_accepts_both_children(role: Role) -> None:
    """What MultiConnector checks before it builds its children: each child's class resolves,
    all support the hybrid KV cache manager, all agree on one KV layout (LBHNC, the only one the
    CPU attention backend supports)."""
    options = ConnectorOptions(cpu_fixes=True, offload_tier_gib=1)
    top = KVTransferConfig(**kv_transfer_config(role, options))
    vllm_config = SimpleNamespace(
        kv_transfer_config=top,
        model_config=SimpleNamespace(use_mla=False),
        attention_config=SimpleNamespace(hisparse_config=None),
    )
    classes = [cls for cls, _ in MultiConnector._get_connector_classes_and_configs(vllm_config)]
    assert [cls.__name__ for cls in classes] == ["NixlConnector", "OffloadingConnector"]
    assert MultiConnector.all_children_support_hma(top)
    assert MultiConnector.get_required_kvcache_layout(vllm_config) == "LBHNC"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("offload_tier_gib", -1, "offload_tier_gib"),
        ("offload_tier_gib", 1e-9, "at least 1 MiB"),
        ("offload_tier_gib", float("nan"), "number of GiB"),
        ("offload_tier_gib", float("inf"), "number of GiB"),
        ("offload_tier_gib", "4", "number of GiB"),
        ("offload_tier_gib", True, "number of GiB"),
        ("offload_eviction_policy", "fifo", "offload_eviction_policy"),
        ("offload_store_threshold", -1, "offload_store_threshold"),
        ("offload_store_threshold", 1.5, "offload_store_threshold"),
        ("offload_store_threshold", True, "offload_store_threshold"),
    ],
)
def test_bad_offload_options_rejected(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorOptions(**{field: value})


def test_manager_honours_the_request_tier_filter() -> None:
    """`kv_load_tiers: []` (no tier may be read) makes stored chunks invisible to that request
    only; vLLM 0.32 applies the filter to secondary tiers alone, HostTierManager to this one."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        _parse_tier_filter,
    )

    engine = start_engine(tier_chunks=3)
    manager = engine.spec.get_manager()
    keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(2)]
    writer = ReqContext(req_id="w")
    manager.on_new_request(writer)
    stored = manager.prepare_store(keys, writer)
    engine.worker.submit_store(1, engine_spec([0, 1]), stored.store_spec)
    manager.complete_store(keys, writer)
    nothing = ReqContext(req_id="n", load_tier_filter=_parse_tier_filter([]))
    cpu_only = ReqContext(req_id="c", load_tier_filter=_parse_tier_filter([{"medium": "cpu"}]))
    storage_only = ReqContext(req_id="s",
                              load_tier_filter=_parse_tier_filter([{"medium": "storage"}]))
    assert [manager.lookup(k, nothing) for k in keys] == [LookupResult.MISS] * 2
    assert [manager.lookup(k, storage_only) for k in keys] == [LookupResult.MISS] * 2
    assert [manager.lookup(k, cpu_only) for k in keys] == [LookupResult.HIT] * 2
    assert [manager.lookup(k, writer) for k in keys] == [LookupResult.HIT] * 2
