"""Fixtures shared across test packages."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def golden_outputs() -> dict:
    """Greedy outputs the dev-mode tests got through the proxy, keyed by (endpoint, prompt
    length): the Ray-mode tests check they serve the same text."""
    return {}
