"""The work queued ahead of a prompt on an engine: each queued prompt at the engine's fitted
cost, less what the oldest one has been computed so far (``RouteCosts.queue_s``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from proxy.costs import RouteCosts
from proxy.ledger import Ledger
from transport.cost import PrefillModel


@dataclass
class Named:
    name: str
    inflight: int = 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


LINEAR = PrefillModel(fixed_s=0.0, tokens_per_s=1000.0)  # 1,000 tokens: 1 s


def test_the_oldest_prompt_is_costed_less_what_it_has_had():
    clock, p0 = Clock(), Named("p0")
    costs = RouteCosts(4096, Ledger(clock))
    assert costs.queue_s("p0", LINEAR) == 0.0  # nothing queued
    first = costs.ledger.claim(p0, prompt_tokens=1000)
    clock.now += 0.1
    costs.ledger.claim(p0, prompt_tokens=1000)  # queued behind it
    clock.now += 0.3
    assert costs.queue_s("p0", LINEAR) == pytest.approx(2.0 - 0.4)
    clock.now += 1.1  # the first overran its 1 s: it may be nearly done, the second is whole
    assert costs.queue_s("p0", LINEAR) == pytest.approx(1.0)
    first.prompt_done()  # ...and the second starts now, not when it was queued
    clock.now += 0.3
    assert costs.queue_s("p0", LINEAR) == pytest.approx(0.7)
    assert costs.ledger.queued_prompts("p0") == ([1000], pytest.approx(0.3))


def test_a_released_prompt_ends_its_turn_and_a_moved_one_queues_anew():
    clock, p0, p1 = Clock(), Named("p0"), Named("p1")
    costs = RouteCosts(4096, Ledger(clock))
    a = costs.ledger.claim(p0, prompt_tokens=500)
    b = costs.ledger.claim(p0, prompt_tokens=500)
    clock.now += 0.2
    a.release()  # dropped (its client left): the next one starts then
    clock.now += 0.1
    assert costs.queue_s("p0", LINEAR) == pytest.approx(0.5 - 0.1)
    b.move_to(p1)  # a retry elsewhere: nothing of it computed there yet
    assert costs.queue_s("p1", LINEAR) == pytest.approx(0.5)
    assert costs.queue_s("p0", LINEAR) == 0.0


def test_each_queued_prompt_is_costed_alone():
    """A fit's quadratic term (attention) applies per prompt: two 1,000-token prompts are not
    one of 2,000 tokens."""
    clock, p0 = Clock(), Named("p0")
    quad = PrefillModel(fixed_s=0.01, tokens_per_s=1000.0, quad_s=1e-6)
    costs = RouteCosts(4096, Ledger(clock))
    costs.ledger.claim(p0, prompt_tokens=1000)
    costs.ledger.claim(p0, prompt_tokens=1000)
    assert costs.queue_s("p0", quad) == pytest.approx(2 * quad.seconds(1000))
    assert costs.queue_s("p0", quad) < quad.seconds(2000)


def test_the_decision_sees_the_remaining_queue():
    clock, p0, d0 = Clock(), Named("p0"), Named("d0")
    costs = RouteCosts(4096, Ledger(clock))
    costs.ledger.claim(p0, prompt_tokens=1000)
    before = costs.inputs("p0", "d0").prefill_queue_s
    clock.now += 0.5
    after = costs.inputs("p0", "d0").prefill_queue_s
    assert before - after == pytest.approx(0.5)
    costs.ledger.claim(d0, prompt_tokens=300)  # a local prefill on the decode engine
    clock.now += 0.1
    local = costs.inputs("p0", "d0")
    assert local.decode_queue_s == pytest.approx(local.local_prefill.seconds(300) - 0.1)
