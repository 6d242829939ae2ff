"""The decode step-time model: fitted from recorded samples (chunked prefills, an outlier), and
the samples read off relayed streams by the step tracker."""

from __future__ import annotations

import pytest

from proxy.step_fit import StepFit
from proxy.step_tracker import KEEP_DONE_S, StepTracker
from transport.cost import PrefillModel, StepModel

TRUE = StepModel(fixed_s=0.004, prefill_s=0.0002, stream_s=0.0005, kv_in_s=0.00001)
PRIOR = StepModel(fixed_s=0.01, prefill_s=0.001, stream_s=0.001, kv_in_s=0.0)


def recorded(chunk: int = 512) -> list[tuple[int, int, int, float]]:
    """Steps of an engine with 1-6 streams: plain decode steps, steps that carry a chunk of a
    2,000-token prompt split at ``chunk`` tokens, and steps during KV pulls."""
    rows = []
    for streams in range(1, 7):
        rows += [(0, streams, 0, TRUE.seconds(0, streams))] * 6
        left = 2000
        while left > 0:
            part = min(chunk, left)
            rows.append((part, streams, 0, TRUE.seconds(part, streams)))
            left -= part
        rows.append((0, streams, 800, TRUE.seconds(0, streams, 800)))
    return rows


def test_fits_recorded_steps_including_chunked_prefills():
    fit = StepFit()
    for row in recorded():
        fit.observe(*row)
    m = fit.model(PRIOR)
    assert m.fixed_s == pytest.approx(TRUE.fixed_s, rel=0.05)
    assert m.prefill_s == pytest.approx(TRUE.prefill_s, rel=0.05)
    assert m.stream_s == pytest.approx(TRUE.stream_s, rel=0.05)
    assert m.kv_in_s == pytest.approx(TRUE.kv_in_s, rel=0.1)
    # What the decision asks: a step carrying a 512-token chunk beside 4 streams.
    assert m.seconds(512, 4) == pytest.approx(TRUE.seconds(512, 4), rel=0.03)


def test_an_outlier_does_not_bend_the_fit():
    fit = StepFit()
    rows = recorded()
    rows.insert(10, (0, 2, 0, 2.5))  # one step stalled by something else (a GC, the OS)
    for row in rows:
        fit.observe(*row)
    assert fit.model(PRIOR).seconds(512, 4) == pytest.approx(TRUE.seconds(512, 4), rel=0.05)


@pytest.mark.parametrize("seed", range(6))
def test_rare_noisy_prefill_steps_among_many_decode_steps_still_make_the_prefill_term(seed):
    """What a CPU engine serving a mix records (SmolLM2): hundreds of ~65 ms decode steps with
    millisecond noise, a few whole 1,023-token prefills in one step each (4.2-4.7 s), some
    64-token ones, KV pulls, and steps stalled by the box (2 s). Judged against the decode steps'
    residuals alone, every prefill step was an outlier and the prefill term fell to 0: a
    1,023-token chunk predicted at 77 ms. The stalled steps still bend nothing."""
    import random

    rng = random.Random(seed)
    fit = StepFit()
    for _ in range(400):
        r, streams = rng.random(), rng.randint(1, 6)
        if r < 0.01:
            row = (1023, streams, 0, 4.2 + rng.uniform(-0.2, 0.5))
        elif r < 0.03:
            row = (63, streams, 0, 0.28 + rng.uniform(-0.03, 0.05))
        elif r < 0.05:
            row = (0, streams, rng.choice([63, 1023]), 0.06 + rng.uniform(0, 0.05))
        elif r < 0.06:
            row = (0, streams, 0, 2.0)
        else:
            row = (0, streams, 0, 0.055 + 0.003 * streams + rng.uniform(0, 0.02))
        fit.observe(*row)
    m = fit.model(PRIOR)
    assert 4.0 < m.seconds(1023, 4) < 5.0
    assert m.seconds(0, 4) < 0.1


def test_terms_never_seen_keep_the_prior():
    fit = StepFit()
    for streams in range(1, 6):  # decode steps only: nothing says what a prefill costs
        for _ in range(4):
            fit.observe(0, streams, 0, TRUE.seconds(0, streams))
    m = fit.model(PRIOR)
    assert m.prefill_s == PRIOR.prefill_s and m.kv_in_s == PRIOR.kv_in_s
    assert m.stream_s == pytest.approx(TRUE.stream_s, rel=0.05)


def test_a_few_prompt_tokens_do_not_make_a_prefill_term():
    """Streams starting beside each other put a few prompt tokens in some steps: too narrow a
    range to say what a long prompt's chunk costs, so the prior's term stays."""
    fit = StepFit()
    for streams in range(1, 6):
        for p in (0, 3, 0, 5):
            fit.observe(p, streams, 0, TRUE.seconds(0, streams) + 0.0001 * (p == 5))
    assert fit.model(PRIOR).prefill_s == PRIOR.prefill_s


def test_too_few_samples_is_the_prior():
    fit = StepFit(min_samples=8)
    for row in recorded()[:5]:
        fit.observe(*row)
    assert fit.model(PRIOR) == PRIOR


def test_tracker_turns_gaps_and_work_into_samples():
    samples: list[tuple[float, float, float, float]] = []
    arrivals: list[tuple[str, float | None, float]] = []
    t = StepTracker(lambda *s: samples.append(s), lambda r, p, m: arrivals.append((r, p, m)))
    a, b = object(), object()
    t.stream_started(a, 0.0)
    t.stream_started(b, 0.0)  # a second stream: its gaps are the same steps, not reported
    for i in range(1, 4):
        t.frame(a, 0.01 * i)
        t.frame(b, 0.01 * i + 0.001)
    assert [s[3] for s in samples] == pytest.approx([0.01, 0.01, 0.01])
    assert all(s[1] == 2 and s[0] == 0 for s in samples)
    # A local prefill of 300 tokens arrives at 0.03 and gets its first byte at 0.13: the step
    # carrying it is the gap 0.03-0.135, which ends just after that first byte.
    t.work_started("x", 0.03, predicted_gap_s=0.1, route="local")
    t.frame(b, 0.04)  # not the reporter
    t.work_done("x", 0.13, prefill_tokens=300)
    held = len(samples)
    t.frame(a, 0.135)
    assert len(samples) == held + 1
    prefill, streams, kv, seconds = samples[-1]
    assert prefill == pytest.approx(300) and streams == 2 and seconds == pytest.approx(0.105)
    t.frame(a, 0.145)
    t.frame(a, 0.13 + KEEP_DONE_S + 1)  # its window for late gaps is over: reported
    assert arrivals == [("local", 0.1, pytest.approx(0.105))]


def test_gaps_wait_for_running_work_and_chunked_work_is_split():
    samples: list[tuple[float, float, float, float]] = []
    t = StepTracker(lambda *s: samples.append(s))
    s = object()
    t.stream_started(s, 0.0)
    t.work_started("long", 0.0)
    for ts in (0.1, 0.2, 0.3, 0.4):  # four chunk steps while a 2,000-token prompt runs
        t.frame(s, ts)
    assert samples == []  # the prompt may still claim them
    t.work_done("long", 0.4, prefill_tokens=2000)
    assert [round(x[0]) for x in samples] == [500, 500, 500, 500]


def test_the_reporter_hands_over_when_its_stream_ends():
    samples: list[tuple[float, float, float, float]] = []
    t = StepTracker(lambda *s: samples.append(s))
    a, b = object(), object()
    t.stream_started(a, 0.0)
    t.stream_started(b, 0.0)
    t.frame(b, 0.5)
    t.stream_ended(a)
    t.frame(b, 0.6)
    assert [x[3] for x in samples] == [pytest.approx(0.1)] and samples[0][1] == 1


#: SmolLM2 on this box, roughly: 64 tokens ~0.19 s, 1,023 tokens ~4.4 s of prefill compute
#: (attention makes a token of a long chunk dearer), beside ~58 ms decode steps.
SHAPE = StepModel(fixed_s=0.058, prefill_s=0.0029, prefill_quad_s=1.4e-6, stream_s=0.0005)


def test_steps_with_long_chunks_price_a_short_chunk_in_the_prior_shape():
    """Only 1,023-token chunks were seen beside the streams (the long half of a mix went
    local). A straight line through them and the decode steps prices a 64-token chunk at the
    long chunk's per-token cost: 0.34 s for a 0.25 s step. The prior's shape, scaled by what
    was seen, prices both."""
    truth = SHAPE
    fit = StepFit()
    for i in range(240):
        streams = 1 + i % 4
        fit.observe(1023 if i % 40 == 39 else 0, streams, 0,
                    truth.seconds(1023 if i % 40 == 39 else 0, streams))
    # The prior's shape (the local prefill model's), 20 % off in scale.
    prior = StepModel(fixed_s=0.005, prefill_s=truth.prefill_s * 1.2,
                      prefill_quad_s=truth.prefill_quad_s * 1.2, stream_s=0.0005)
    fit.model(prior)  # the shape the next refit scales
    for i in range(32):
        fit.observe(0, 2, 0, truth.seconds(0, 2))
    m = fit.model(prior)
    assert m.seconds(1023, 2) == pytest.approx(truth.seconds(1023, 2), rel=0.03)
    assert m.seconds(64, 2) == pytest.approx(truth.seconds(64, 2), rel=0.05)


def test_the_prior_prices_a_chunk_at_the_local_prefill_models_own_shape():
    """Before any step beside the streams carried a prompt, a chunk of n tokens costs what the
    engine's local prefill model says n tokens cost (less its fixed part, which is the step's).
    Taking the per-token cost of a full 2,048-token chunk priced 64 tokens at 2x."""
    from proxy.costs import RouteCosts

    costs = RouteCosts(kv_bytes_per_token=1000, chunk_tokens=2048)
    local = PrefillModel(fixed_s=0.06, tokens_per_s=1 / 0.0029, quad_s=1.4e-6)
    for n in (32, 64, 128, 256, 512, 768, 1023, 64, 1023, 256):
        costs.observe_local_prefill("decode-0", n, local.seconds(n))
    step = costs.step_model("decode-0")
    for n in (64, 1023):
        assert step.prefill_seconds(n) == pytest.approx(local.seconds(n) - local.fixed_s,
                                                        rel=0.05)


def test_one_step_with_a_kv_pull_does_not_make_the_kv_term():
    """A KV pull that ran beside a local prefill: its one step is slow for the prefill's sake.
    Fitted alone it would price a token of KV at seconds' worth of a stall."""
    fit = StepFit()
    for i in range(120):
        chunk = 1023 if i % 20 == 19 else 0
        fit.observe(chunk, 2, 0, SHAPE.seconds(chunk, 2))
    fit.observe(512, 2, 200, SHAPE.seconds(1023, 2))  # slower than its 512 tokens explain
    for i in range(40):
        fit.observe(0, 2, 0, SHAPE.seconds(0, 2))
    prior = StepModel(fixed_s=0.005, prefill_s=SHAPE.prefill_s,
                      prefill_quad_s=SHAPE.prefill_quad_s, stream_s=0.0005, kv_in_s=1e-5)
    assert fit.model(prior).kv_in_s == prior.kv_in_s


def test_a_warm_fit_refits_at_most_once_per_interval():
    """Once past its first samples, the fit refits every 32 samples but not more often than
    ``refit_interval_s``: a refit costs ~0.7 ms on some request's path, and a busy proxy gets
    thousands of samples a second. The first fits (the samples doubling) are not held back."""
    now = [0.0]
    fit = StepFit(refit_interval_s=0.5, clock=lambda: now[0])
    for _ in range(64):  # warm: 8, 16, 32 and 64 samples each refitted at once
        fit.observe(0, 2, 0, 0.010)
    assert fit.model(PRIOR).fixed_s == pytest.approx(0.010, rel=0.05)
    for _ in range(64):  # twice refit_every later, within the interval: not refitted
        fit.observe(0, 2, 0, 0.030)
    assert fit.model(PRIOR).fixed_s == pytest.approx(0.010, rel=0.05)
    now[0] = 0.6
    fit.observe(0, 2, 0, 0.030)  # the interval is over: this sample refits
    assert fit.model(PRIOR).fixed_s > 0.015
