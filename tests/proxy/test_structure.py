"""Issue 15's structural targets, kept: no module of ``proxy/`` over 300 lines, and an engine's
load changed in one place (``proxy/ledger.py``), so that a reservation's balance is visible
there and nowhere else."""

from __future__ import annotations

import ast
from pathlib import Path

PROXY = Path(__file__).resolve().parents[2] / "proxy"
LOAD_FIELDS = {"prompt_tokens", "output_tokens", "requests"}


def load_writes(source: str) -> list[str]:
    """Assignments in ``source`` that change an engine's load: ``x.inflight`` for any ``x``
    but ``self`` (an object's own counter, e.g. admission's), and the ledger's load fields."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            if not isinstance(t, ast.Attribute):
                continue
            own = isinstance(t.value, ast.Name) and t.value.id == "self"
            if (t.attr == "inflight" and not own) or t.attr in LOAD_FIELDS:
                found.append(f"line {t.lineno}: {ast.unparse(t)}")
    return found


def test_no_proxy_module_is_over_300_lines():
    long = {p.name: n for p in PROXY.glob("*.py")
            if (n := len(p.read_text().splitlines())) > 300}
    assert not long, long


def test_only_the_ledger_changes_an_engines_load():
    writes = {p.name: w for p in PROXY.glob("*.py") if p.name != "ledger.py"
              and (w := load_writes(p.read_text()))}
    assert not writes, writes


def test_the_load_check_sees_a_write_by_hand():
    """(The test above can fail: the writes the orchestrator used to make by hand are seen.)"""
    assert load_writes("decode.inflight += 1\nload.prompt_tokens -= n\n") == [
        "line 1: decode.inflight", "line 2: load.prompt_tokens"]
    assert load_writes("self.inflight += 1\n") == []
