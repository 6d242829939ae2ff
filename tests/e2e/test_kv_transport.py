"""A same-node pair's KV takes shared memory (issue 18, item 3). On the dev stack both engines are
on this machine: the decode engine's UCX reads the prefill engine's KV by ``cma`` (zero-copy,
``process_vm_readv``), not over tcp. The tiny stack's engines run with ``UCX_PROTO_INFO=y``
(``conftest.py``), so UCX logs the protocol it chose for each operation to each peer; that log
is what this test reads. (Across nodes, UCX cannot reach a peer by ``cma`` and takes tcp: the
two-node test, ``tests/ray/test_placement.py``, shows that pair's KV on the shaped link.)"""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from harness.prompts import text_of_tokens

#: A row of a UCX protocol table: "| 0..inf | zero-copy | cma/memory |" (range, how, transport).
ROW = re.compile(r"\|\s*(\d+\.\.\w+)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|")


def protocols(log: Path, operation: str) -> list[list[tuple[str, str]]]:
    """Each UCX protocol table in ``log`` for ``operation`` (e.g. "remote memory read"): its rows'
    (description, transport/device)."""
    tables: list[list[tuple[str, str]]] = []
    current: list[tuple[str, str]] | None = None
    lines = log.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if " cfg#" in line:  # a table's first line: the peer and the configuration
            current = None
            if i + 1 < len(lines) and operation in lines[i + 1]:
                current = []
                tables.append(current)
        elif current is not None and (m := ROW.search(line)):
            current.append((m.group(2), m.group(3)))
    return tables


def test_a_same_node_hand_over_reads_the_kv_through_shared_memory(tiny_stack):
    r = httpx.post(tiny_stack.proxy_url + "/v1/completions", timeout=120, json={
        "model": tiny_stack.model_name, "prompt": text_of_tokens(600, seed=901),
        "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.headers["x-pd-route"] == "disaggregated", r.text
    (decode_log,) = tiny_stack.log_dir.glob("decode-*.log")
    reads = protocols(decode_log, "remote memory read")
    print(f"UCX reads by the decode engine: {reads}")
    assert reads, "no UCX read protocol logged (UCX_PROTO_INFO not set, or no KV read)"
    for rows in reads:
        assert rows and all(transport.startswith("cma/") for _, transport in rows), rows
