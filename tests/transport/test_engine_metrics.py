"""``transport/engine_metrics.py``, the one reader of an engine's ``/metrics``: what a page's
figures read as, including the ones that tell nothing."""

from transport.engine_metrics import engine_load


def test_a_figure_read_as_nan_or_infinite_is_none_and_an_absent_one_zero():
    load = engine_load('vllm:num_requests_running{engine="0"} NaN\n'
                       'vllm:num_requests_waiting{engine="0"} 2\n'
                       'vllm:nixl_xfer_time_seconds_count +Inf\n'
                       'vllm:prompt_tokens_total{engine="0"} -Inf\n')
    assert load.requests_running is None and load.requests is None
    assert load.requests_waiting == 2
    assert load.nixl_transfers is None and load.prompt_tokens is None
    assert load.requests_finished == 0 and load.nixl_failed == 0  # absent: nothing happened


def test_a_nan_in_one_label_set_makes_the_sum_unknown():
    load = engine_load('vllm:num_requests_running{engine="0"} 1\n'
                       'vllm:num_requests_running{engine="1"} NaN\n'
                       'vllm:num_requests_waiting{engine="0"} 0\n')
    assert load.requests_running is None and load.requests is None
