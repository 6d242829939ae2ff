"""What each engine is asked to do (its duties), from an operator's order: a pure function.

Used by :meth:`proxy.pool.EnginePool.assign` (``POST /pd/admin/routing``)."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.engine import Engine


def assigned_duties(engines: Sequence[Engine], prefill: Sequence[str], decode: Sequence[str]
                    ) -> dict[str, frozenset[str]]:
    """Each engine's duties by name: ``prefill`` for those named in ``prefill``, ``decode`` for
    those in ``decode``, none for the rest (an engine of a fixed role left out is cordoned).
    Naming an unknown engine, or one for a duty its role cannot do, or leaving no engine to
    decode, is a ValueError."""
    names = {e.name: e for e in engines}
    for name in (*prefill, *decode):
        if name not in names:
            raise ValueError(f"no engine named {name!r}")
    for name in prefill:
        if not names[name].can("prefill"):
            raise ValueError(f"{name} ({names[name].role}) cannot prefill for others")
    for name in decode:
        if not names[name].can("decode"):
            raise ValueError(f"{name} ({names[name].role}) cannot decode")
    new = {e.name: frozenset(d for d, listed in (("prefill", prefill), ("decode", decode))
                             if e.name in listed) for e in engines}
    if not any("decode" in duties for duties in new.values()):
        raise ValueError("at least one engine must decode")
    return new
