"""Markers shared by the test packages."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest


def mark_e2e(items: Iterable[Any], package: str) -> None:
    """Mark the tests collected from ``tests/<package>/`` as end-to-end (real engines)."""
    for item in items:
        if f"/{package}/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


def last_in_package(items: list[Any], module: str) -> None:
    """Run the tests of ``module`` (a path ending, e.g. ``/layouts/test_x.py``) after every other
    test of its package, in their own order: tests that leave an engine restarting go last, so
    nobody waits for the restart. They still set up what they need themselves."""
    moved = [item for item in items if str(item.fspath).endswith(module)]
    if not moved:
        return
    package = str(moved[0].fspath).rsplit("/", 1)[0] + "/"
    rest = [item for item in items if item not in moved]
    after = max((i for i, item in enumerate(rest) if str(item.fspath).startswith(package)),
                default=len(rest) - 1)
    items[:] = rest[:after + 1] + moved + rest[after + 1:]
