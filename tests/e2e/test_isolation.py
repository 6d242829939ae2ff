"""Dev mode keeps each engine on its own core: every process and thread of its tree."""

from __future__ import annotations

from launch.isolation import parse_cores, tree_threads


def test_each_engine_tree_is_on_its_own_core(tiny_stack):
    placed = {}
    for engine in tiny_stack.run_info()["engines"]:
        cores = parse_cores(engine["cpu_cores"])
        threads = tree_threads(engine["pid"])
        assert len(threads) > 20  # the API server, EngineCore and worker and their threads
        assert {t.cores for t in threads} == {cores}, [t for t in threads if t.cores != cores]
        placed[engine["role"]] = cores
    assert not placed["prefill"] & placed["decode"]
    assert "every process and thread on core" in tiny_stack.output()
