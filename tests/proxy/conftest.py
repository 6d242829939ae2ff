"""Fixtures shared by the proxy tests: one fake engine per role, stopped (gates released) after.

``test_proxy_app.py`` still defines the same two fixtures itself; its copies take precedence there
and can go.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from harness.fake_engine import FakeEngine


@pytest.fixture
async def prefill() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine("prefill")
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.fixture
async def decode() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine("decode")
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()
