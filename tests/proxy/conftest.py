"""Fixtures shared by the proxy tests: one fake engine per role, stopped (gates released) after.

``test_proxy_app.py`` still defines the same two fixtures itself; its copies take precedence there
and can go.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from harness.fake_engine import FakeEngine


async def _engine(name: str) -> AsyncIterator[FakeEngine]:
    engine = FakeEngine(name)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.fixture
async def prefill() -> AsyncIterator[FakeEngine]:
    async for engine in _engine("prefill"):
        yield engine


@pytest.fixture
async def decode() -> AsyncIterator[FakeEngine]:
    async for engine in _engine("decode"):
        yield engine


@pytest.fixture
async def decode2() -> AsyncIterator[FakeEngine]:
    """A second decode engine (a stream migrates to it)."""
    async for engine in _engine("decode-2"):
        yield engine
