"""benchmarks/goodput.py's accounting on recorded per-request samples: what counts as good,
attainment over a run, the highest rate at >= 90 % good, and the mixed workload's dataset as
vLLM's own loader reads it."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.goodput import (
    WORKLOADS,
    attainment,
    highest_good_rate,
    is_good,
    mean_attainment,
    mixed_dataset,
    p99,
    ratio_medians,
)

TTFT_S, ITL_S = 0.5, 0.05


def test_one_long_stall_under_a_fine_mean_tpot_is_not_good():
    """31 gaps of 10 ms and one of 1 s: the mean TPOT (what ``--goodput`` judges) is under
    the 50 ms target, the request's own p99 gap is not."""
    gaps = [0.010] * 31 + [1.0]
    assert statistics.mean(gaps) < ITL_S
    assert not is_good(0.2, gaps, TTFT_S, ITL_S)
    assert is_good(0.2, [0.010] * 32, TTFT_S, ITL_S)


def test_p99_is_the_requests_own_and_counts_stalls_above_one_in_a_hundred():
    # A 256-token answer: 255 gaps. Three stalls are over 1 % of them: not good. Two are
    # within what a p99 allows (the definition of the target, not a loophole of the code).
    assert not is_good(0.2, [0.010] * 252 + [1.5] * 3, TTFT_S, ITL_S)
    assert is_good(0.2, [0.010] * 253 + [1.5] * 2, TTFT_S, ITL_S)
    assert p99([0.01] * 99 + [9.0]) == 0.01 and p99([0.01] * 98 + [9.0] * 2) == 9.0


def test_ttft_over_its_target_or_missing_is_not_good():
    assert not is_good(0.6, [0.01] * 10, TTFT_S, ITL_S)
    assert not is_good(0.0, [0.01] * 10, TTFT_S, ITL_S)  # vLLM records 0 for a failed request
    assert is_good(0.5, [], TTFT_S, ITL_S)  # a one-token answer has no gaps


def test_attainment_judges_each_request_by_its_prompt_lengths_target():
    mix = WORKLOADS["mixed"]
    long_in, short_in = sorted({inp for inp, _, _ in mix}, reverse=True)
    targets = {"ttft_s": {str(long_in): 2.0, str(short_in): 0.2}, "itl_s": ITL_S}
    result = {
        # a long prompt at 1.5 s (good for its class), a short one at 1.5 s (not), a short
        # one with a stall, a failed request, a good short one
        "ttfts": [1.5, 1.5, 0.1, 0.0, 0.1],
        "itls": [[0.01] * 15, [0.01] * 15, [0.01] * 200 + [2.0] * 5, [], [0.01] * 255],
        "input_lens": [long_in - 1, short_in + 2, short_in, short_in, short_in - 3],
        "errors": ["", "", "", "Server disconnected", ""],
    }
    got = attainment(result, targets, mix)
    assert got == {"requests": 5, "good": 2, "failed": 1, "attainment": 0.4}


def test_highest_good_rate_interpolates_the_crossing():
    assert highest_good_rate([(1.0, 1.0), (2.0, 0.95), (4.0, 0.5)]) == pytest.approx(
        2.0 + 2.0 * (0.95 - 0.9) / (0.95 - 0.5))
    assert highest_good_rate([(4.0, 0.95), (1.0, 1.0), (2.0, 1.0)]) == 4.0  # all good
    assert highest_good_rate([(1.0, 0.8), (2.0, 1.0)]) is None  # missed at the lowest rate
    # Attainment that dips and recovers: the first crossing is the figure.
    assert highest_good_rate([(1.0, 1.0), (2.0, 0.9), (3.0, 0.5), (4.0, 0.95)]) == \
        pytest.approx(2.0)


def test_mixed_dataset_is_read_by_vllms_own_loader(tmp_path):
    """The mixed workload goes through ``vllm bench serve``'s custom dataset: every row is
    read back with its prompt and output length, in the workload's shares."""
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets.datasets import CustomDataset

    from launch.models import ensure_model

    tokenizer = str(ensure_model("tiny"))
    mix = WORKLOADS["mixed"]
    path = mixed_dataset(tokenizer, mix, 8, seed=3, data_dir=tmp_path)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    samples = CustomDataset(dataset_path=str(path), random_seed=0).sample(
        tokenizer=tok, num_requests=8, output_len=-1, skip_chat_template=True,
        request_id_prefix="t")
    assert len(samples) == 8
    # Request i is sent as "<prefix>i": the proxy's decision log joins on that.
    assert [s.request_id for s in samples] == [f"t{i}" for i in range(8)]
    shares = {out: 0 for _, out, _ in mix}
    for s in samples:
        shares[s.expected_output_len] += 1
        inp = next(i for i, out, _ in mix if out == s.expected_output_len)
        assert inp - 8 <= s.prompt_len <= inp
    assert shares == {out: round(8 * share) for _, out, share in mix}
    assert len({s.prompt for s in samples}) == 8


def test_prediction_ratio_medians_from_one_points_bucket_deltas():
    """Cumulative buckets as the proxy exports them, one point's difference: 4 ITL
    observations in (0.9, 1.0], 6 in (1.0, 1.1] -> median 1.0 + 0.1 x (5 - 4) / 6."""
    h = "pd_itl_prediction_ratio"
    delta = {f"{h}|local|0.9": 0, f"{h}|local|1.0": 4, f"{h}|local|1.1": 10,
             f"{h}|local|+Inf": 10, f"{h}|disaggregated|4.0": 0,
             f"{h}|disaggregated|+Inf": 3,  # all beyond the last bound: that bound
             "pd_ttft_prediction_ratio|local|+Inf": 0, "local": 10, "local/forced": 1}
    medians = ratio_medians(delta)
    assert medians["itl"]["local"] == pytest.approx(1.0 + 0.1 / 6, abs=1e-3)
    assert medians["itl"]["disaggregated"] == 4.0
    assert medians["ttft"]["local"] is None


def test_mean_attainment_is_one_repeats_curve_averaged_over_rates():
    points = [{"repeat": 0, "attainment": a} for a in (1.0, 0.5, 0.0)] + [
        {"repeat": 1, "attainment": 0.9}]
    assert mean_attainment(points, 0) == 0.5 and mean_attainment(points, 1) == 0.9


def test_each_request_carries_the_ttft_target_of_its_own_prompt_length(tmp_path):
    """The ``slo_ttft`` arm: vLLM's sampled requests each get a per-request body (vLLM merges
    ``request_overrides`` over ``--extra-body``) with the run's gap target and the TTFT target
    of the prompt length it stands for."""
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets.datasets import CustomDataset

    from benchmarks.goodput import with_own_targets
    from launch.models import ensure_model

    tokenizer = str(ensure_model("tiny"))
    mix = WORKLOADS["mixed"]
    path = mixed_dataset(tokenizer, mix, 8, seed=3, data_dir=tmp_path)
    samples = CustomDataset(dataset_path=str(path), random_seed=0).sample(
        tokenizer=AutoTokenizer.from_pretrained(tokenizer), num_requests=8, output_len=-1,
        skip_chat_template=True)
    out = with_own_targets(samples, mix, {"itl_ms": 90.0}, {"1024": 4000.0, "64": 300.0})
    for s in out:
        ttft = 4000.0 if s.expected_output_len == 16 else 300.0  # 1,024-token prompts: 16 out
        assert s.request_overrides == {"slo": {"itl_ms": 90.0, "ttft_ms": ttft}}
    assert {s.request_overrides["slo"]["ttft_ms"] for s in out} == {4000.0, 300.0}
