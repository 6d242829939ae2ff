"""`pdserve plan`: breakeven bandwidth and crossover prompt length."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from launch.plan import PRESETS, plan_link, resolve_link

SMOLLM2_FP32 = 46_080


def test_breakeven_is_kv_bytes_times_prefill_rate():
    p = plan_link(SMOLLM2_FP32, 600.0, resolve_link("10", 1.0))
    assert p.breakeven_gbit_per_s == pytest.approx(SMOLLM2_FP32 * 600 * 8 / 1e9)


def test_crossover_matches_the_closed_form():
    # transfer(n) = f + n*b/B beats recompute(n) = n/r from n* = f / (1/r - b/B).
    rate, gbit, fixed_ms = 600.0, 0.5, 30.0
    p = plan_link(SMOLLM2_FP32, rate, resolve_link(str(gbit), fixed_ms))
    n_star = (fixed_ms / 1e3) / (1 / rate - SMOLLM2_FP32 * 8 / (gbit * 1e9))
    assert p.crossover_tokens == math.floor(n_star) + 1
    # ...and the table agrees on both sides of it.
    for n, transfer_ms, recompute_ms in p.rows:
        assert (transfer_ms < recompute_ms) == (n >= p.crossover_tokens)


def test_under_breakeven_recompute_always_wins():
    p = plan_link(SMOLLM2_FP32, 600.0, resolve_link("0.1", 0.0))
    assert p.breakeven_gbit_per_s > 0.1
    assert p.crossover_tokens is None
    assert all(t > r for _, t, r in p.rows)


def test_presets_and_bad_links():
    assert {"nvlink", "pcie5", "rdma400", "eth100"} <= set(PRESETS)
    assert resolve_link("RDMA400", None).gbit_per_s == 400
    assert resolve_link("eth100", 7.0).fixed_ms == 7.0
    for bad in ("warp", "0", "-3", "nan"):
        with pytest.raises(ValueError):
            resolve_link(bad, None)
    with pytest.raises(ValueError):
        plan_link(SMOLLM2_FP32, 0.0, resolve_link("10", None))


def _pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_from_a_config_file(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "hidden_size": 4096}))
    out = _pdserve("plan", "--model", str(cfg), "--prefill-rate", "10000", "--link", "eth100",
                   "--link", "1", "--json")
    assert out.returncode == 0, out.stderr
    eth, slow = json.loads(out.stdout)
    assert eth["kv_bytes_per_token"] == 128 * 1024  # Llama-3-8B, bf16
    assert eth["breakeven_gbit_per_s"] == pytest.approx(128 * 1024 * 10000 * 8 / 1e9)
    assert eth["crossover_tokens"] is not None and slow["crossover_tokens"] is None
    text = _pdserve("plan", "--model", str(cfg), "--prefill-rate", "10000")
    assert text.returncode == 0 and "breakeven link bandwidth: 10.49 Gb/s" in text.stdout
    assert all(name in text.stdout for name in PRESETS)


def test_cli_rejects_bad_input_clearly(tmp_path):
    out = _pdserve("plan", "--model", str(tmp_path / "nope"), "--prefill-rate", "1")
    assert out.returncode == 2 and "no model config" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("link, fixed_ms, rate", [
    ("1", 5.0, 1_000.0), ("0.1", 50.0, 150.0), ("0.3", 30.0, 500.0), ("10", 1.0, 15_000.0)])
def test_the_proxy_flips_its_route_at_the_crossover_plan_predicts(link, fixed_ms, rate):
    """Issue 18, item 4: `pdserve plan`'s crossover for a link is where the proxy's `auto`
    policy, given the same link and prefill models, flips from recomputing to moving the KV
    (the prompt cached on the prefill engine, as the planner assumes). On real engines across
    two shaped nodes: `benchmarks/README.md`, load_or_recompute --two-nodes."""
    from proxy.policy import decide
    from proxy.policy_mode import parse_policy
    from proxy.route_inputs import CostInputs, RouteInputs
    from transport.cost import LinkModel, PrefillModel

    preset = resolve_link(link, fixed_ms)
    p = plan_link(SMOLLM2_FP32, rate, preset)
    assert p.crossover_tokens is not None and p.crossover_tokens > 1
    costs = CostInputs(
        kv_bytes_per_token=SMOLLM2_FP32,
        remote_prefill=PrefillModel(fixed_s=0.0, tokens_per_s=math.inf),
        local_prefill=PrefillModel(fixed_s=0.0, tokens_per_s=rate),
        link=LinkModel(fixed_s=preset.fixed_ms / 1e3, bytes_per_s=preset.gbit_per_s * 1e9 / 8))

    def route(n: int) -> str:
        inputs = RouteInputs(prompt_tokens=n, prefill_cached_tokens=n, costs=costs)
        return decide(parse_policy("auto"), inputs).route

    n = p.crossover_tokens
    assert (route(n - 1), route(n)) == ("local", "disaggregated")
    assert route(n // 2) == "local" and route(2 * n) == "disaggregated"
