"""Cordoning an engine of a fixed role (``POST /pd/admin/routing`` leaving it out of its duty's
list): it is given nothing new, even where it holds the prompt's prefix; listed again, it is
picked again. Bad orders change nothing."""

from __future__ import annotations

import re

import pytest

from tests.proxy.test_routing import PROMPT, cache, request, setup


async def test_a_cordoned_decode_engine_gets_nothing_new_even_holding_the_prompt():
    pool, _, orch = setup()
    cache(pool.get("d0"), PROMPT)  # d0 would be the cheapest: it holds the whole prompt
    assert (await orch.plan(request())).decode.name == "d0"
    pool.assign(prefill=["p0", "p1"], decode=["d1"])
    assert pool.get("d0").duties == frozenset() and [e.name for e in pool.decode] == ["d1"]
    for _ in range(3):
        assert (await orch.plan(request())).decode.name == "d1"
    pool.assign(prefill=["p0", "p1"], decode=["d0", "d1"])  # listed again: picked again
    assert (await orch.plan(request())).decode.name == "d0"


async def test_a_cordoned_prefill_engine_gets_nothing_new_even_holding_the_prompt():
    pool, _, orch = setup()
    cache(pool.get("p1"), PROMPT)
    assert (await orch.plan(request())).prefill.name == "p1"
    pool.assign(prefill=["p0"], decode=["d0", "d1"])
    for _ in range(3):
        assert (await orch.plan(request())).prefill.name == "p0"
    pool.assign(prefill=[], decode=["d0", "d1"])  # every prefill engine cordoned: no P/D
    assert (await orch.plan(request())).prefill is None


@pytest.mark.parametrize("prefill, decode, message", [
    (["p0"], [], "at least one engine must decode"),
    (["d0"], ["d0"], "d0 (decode) cannot prefill"),
    (["p0"], ["p0"], "p0 (prefill) cannot decode"),
    (["p0"], ["nope"], "no engine named 'nope'"),
])
def test_impossible_duties_are_refused_and_change_nothing(prefill, decode, message):
    pool, _, _ = setup()
    before = {e.name: e.duties for e in pool.all()}
    with pytest.raises(ValueError, match=re.escape(message)):
        pool.assign(prefill=prefill, decode=decode)
    assert {e.name: e.duties for e in pool.all()} == before
