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
