"""Which engines a scale-down removes (``proxy/scale_down.py``): table-driven."""

from __future__ import annotations

import pytest

from proxy.scale_down import pick_removals


@pytest.mark.parametrize(("names", "keep", "down", "removed"), [
    (["d-0", "d-1", "d-2"], 2, set(), ["d-2"]),  # all up: the newest goes
    (["d-0", "d-1"], 1, {"d-0"}, ["d-0"]),  # the one down goes, not the live newest
    (["d-0", "d-1", "d-2"], 1, {"d-1"}, ["d-1", "d-2"]),  # down first, then the newest
    (["d-0", "d-1", "d-2"], 1, {"d-0", "d-1"}, ["d-0", "d-1"]),
    (["d-0", "d-1"], 2, {"d-0"}, []),  # nothing to remove
    (["d-0"], 3, set(), []),
])
def test_engines_down_go_before_the_newest(names, keep, down, removed):
    assert pick_removals(names, keep, lambda n: n not in down) == removed
