"""The fits on degenerate samples: sizes too close to tell a per-token cost, a window with no
growth, a sample that is not a number, a fitted excess that would make a gap shorter than a
step, and steps spanned by work whose share is not known."""

from __future__ import annotations

import math

from proxy.estimators import LinkFit, PrefillFit
from proxy.step_fit import StepFit
from proxy.step_tracker import StepTracker
from transport.cost import LinkModel, PrefillModel, StepModel

KVB = 100_000  # KV bytes per token


def test_hand_overs_of_close_sizes_keep_the_links_bandwidth():
    """512 and 520 tokens, the larger 10 ms faster: noise, not an infinitely fast link."""
    fit = LinkFit(LinkModel(0.03, 20e6), KVB)
    for n, s in [(512, 2.60), (520, 2.59), (512, 2.60)]:
        fit.observe(n, s)
    model = fit.model()
    assert model.bytes_per_s == 20e6
    assert math.isclose(model.seconds(516, KVB), 2.597, rel_tol=0.01)  # the fixed cost refitted
    assert model.seconds(8192, KVB) > 40


def test_a_window_of_hand_overs_with_no_growth_is_not_an_infinitely_fast_link():
    fit = LinkFit(LinkModel(0.03, 20e6), KVB)
    for n, s in [(256, 1.5), (1024, 1.4), (256, 1.5), (1024, 1.4)]:
        fit.observe(n, s)
    assert fit.model().bytes_per_s == 20e6


def test_prefills_of_close_sizes_keep_the_per_token_cost():
    fit = PrefillFit(PrefillModel(0.02, 2000.0))
    for n, s in [(512, 0.26), (520, 0.259), (512, 0.26)]:
        fit.observe(n, s)
    assert fit.model().tokens_per_s == 2000.0
    assert fit.model().seconds(8192) > 4


def test_sizes_that_span_enough_fit_every_term():
    fit = LinkFit(LinkModel(0.03, 20e6), KVB)
    for n in (256, 1024, 512):
        fit.observe(n, 0.01 + n * KVB / 50e6)
    assert math.isclose(fit.model().bytes_per_s, 50e6, rel_tol=0.01)


def test_a_sample_that_is_not_a_number_is_dropped():
    step = StepFit()
    for i in range(8):
        step.observe(0, 1 + i % 3, 0, 0.01)
    step.observe(0, 1, 0, float("nan"))
    step.observe(0, 1, 0, float("inf"))
    for i in range(8):  # (the window doubled: a refit, with the bad samples had they stayed)
        step.observe(0, 1 + i % 3, 0, 0.01)
    fitted = step.model(StepModel(0.005, 0.0005, 0.0005))
    assert math.isclose(fitted.seconds(0, 2), 0.01, rel_tol=0.05)
    link = LinkFit(LinkModel(0.03, 20e6), KVB)
    link.observe(512, float("nan"))
    assert link.n_samples == 0


def test_a_gap_is_never_predicted_shorter_than_a_plain_step():
    """A fitted excess with a negative intercept (0 s at 500 tokens, 0.2 s at 1,500) would
    make a small hand-over's gap negative."""
    model = StepModel(0.01, 0.0, 0.001, handover_fixed_s=-0.1, handover_s=2e-4,
                      local_fixed_s=-0.1, local_s=2e-4)
    plain = model.seconds(0, 2)
    assert model.handover_gap(2, 64) == plain
    assert model.local_gap(64, 2048, 2) == model.seconds(64, 2)
    assert model.handover_gap(2, 1500) > plain


def test_steps_spanned_by_work_with_no_first_byte_are_no_samples():
    """A whole (unstreamed) reply's prompt is computed in steps the streams beside it see; its
    work ends with no first byte, its share unknown: those gaps are not plain decode steps."""
    samples: list[tuple[float, float, float, float]] = []
    tracker = StepTracker(lambda *s: samples.append(s))
    tracker.stream_started("stream", 0.0)
    now = 0.0
    for _ in range(3):
        now += 0.01
        tracker.frame("stream", now)
    tracker.work_started("whole", now)
    for dt in [0.01] * 5 + [0.5] + [0.01] * 5:
        now += dt
        tracker.frame("stream", now)
    tracker.work_dropped("whole", now + 0.01)
    assert samples and all(s[3] < 0.1 for s in samples)  # the 0.5 s step is not among them
