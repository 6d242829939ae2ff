"""Edges of the request path: a stream's continuation (what it carries, what it is refused
for), the ledger's counts across an engine's restart and a decode retry, and the request
deadline reaching a stream whose client is slow to take it. (Migrations through the proxy:
``tests/proxy/test_migration.py``.)"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

from proxy.engine import Engine
from proxy.engine_client import EngineStream
from proxy.errors import DecodeLost, RequestDeadline
from proxy.ledger import Ledger
from proxy.metrics import ProxyMetrics
from proxy.migration import budget_left, continuation, migrating, not_migratable
from proxy.relay import relay
from proxy.requests import ApiRequest
from proxy.transcript import Transcript
from tests.proxy.test_proxy_app import chat_body, completions_body

# --- stream migration ------------------------------------------------------------------------


def _event(text: str, token: int) -> bytes:
    obj = {"id": "cmpl-a", "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None,
                        "token_ids": [token]}]}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def test_tokens_delivered_with_no_prompt_ids_known_are_not_started_over():
    """A continuation is the prompt's ids plus the delivered ones: without the first, the
    request itself would be sent again, and the answer start over after what was delivered."""
    req = ApiRequest("completions", completions_body(stream=True, max_tokens=8), True, "r")
    metrics, resumed = ProxyMetrics(), []

    async def lost():
        yield _event("The", 50000)  # (no prompt_token_ids: the engine sent none)
        yield DecodeLost("lost", engine="d1")

    async def resume(nxt, failed):
        resumed.append(nxt)
        raise AssertionError("not to be continued")

    out = [x async for x in migrating(req, lost(), "d1", resume, 3, metrics, None, None)]
    assert resumed == [] and isinstance(out[-1], DecodeLost)
    assert metrics.registry.get_sample_value(
        "pd_migrations_failed_total", {"reason": "unknown_prompt"}) == 1


def test_the_budget_is_the_one_vllm_reads():
    delivered = Transcript(False, False)
    delivered.output_ids = [1, 2]
    chat = ApiRequest("chat", chat_body(max_tokens=4, max_completion_tokens=None), True, "r")
    assert budget_left(chat, delivered, 4096) == 2  # a null max_completion_tokens: max_tokens
    completion = ApiRequest("completions", completions_body(
        max_tokens=10, max_completion_tokens=2), True, "r")
    assert budget_left(completion, delivered, None) == 8  # a completion reads max_tokens only


def test_a_continuation_is_not_truncated_again_and_keeps_its_cache_salt():
    delivered = Transcript(False, False)
    delivered._prompt, delivered.output_ids = [1, 2, 3, 4, 5], [9, 9]
    req = ApiRequest("completions", completions_body(
        stream=True, truncate_prompt_tokens=5, truncation_side="left"), True, "r")
    nxt = continuation(req, delivered, 6).body
    assert nxt["prompt"] == [1, 2, 3, 4, 5, 9, 9]
    assert "truncate_prompt_tokens" not in nxt and "truncation_side" not in nxt
    chat = ApiRequest("chat", chat_body(stream=True, cache_salt="tenant-7"), True, "r")
    assert continuation(chat, delivered, 6).body["cache_salt"] == "tenant-7"


def test_a_chat_with_an_image_or_sound_is_not_continued():
    for part in ({"type": "image_url", "image_url": {"url": "data:,"}},
                 {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}):
        body = chat_body(messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this"}, part]}])
        assert not_migratable(body) == "multimodal"
    assert not_migratable(chat_body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "plain"}]}])) is None


# --- the ledger ------------------------------------------------------------------------------


def _engine(name: str) -> Engine:
    return Engine("decode", SimpleNamespace(name=name))  # type: ignore[arg-type]


def test_an_engine_restarted_under_its_name_counts_only_its_own_requests():
    """``pool.reconcile`` puts a new Engine in place of a restarted one; requests still on the
    old one end there."""
    ledger, old = Ledger(), _engine("d0")
    before = ledger.claim(old, output_tokens=10)
    new = _engine("d0")
    after = ledger.claim(new, output_tokens=10)
    assert (old.inflight, new.inflight) == (1, 1)
    after.release()
    before.release()
    assert (old.inflight, new.inflight) == (0, 0)


def test_a_retried_decode_holds_its_stalls_on_the_engine_it_moved_to():
    ledger, a, b = Ledger(), _engine("a"), _engine("b")
    on_a = ledger.claim(a, output_tokens=1000, itl_s=0.05)
    on_b = ledger.claim(b, output_tokens=1000, itl_s=0.05)
    room_a, room_b = on_a.stall_room, on_b.stall_room
    arriving = ledger.claim(a, output_tokens=100, itl_s=0.05)
    arriving.hold_stalls(3)
    arriving.move_to(b)
    assert (on_a.stall_room, on_b.stall_room) == (room_a, room_b - 3)
    arriving.release()
    assert (on_a.stall_room, on_b.stall_room) == (room_a, room_b)


# --- the request deadline --------------------------------------------------------------------


class _Response:
    """An engine's stream: one event now, the next much later."""
    status = 200

    def __init__(self) -> None:
        self._left = [b"data: {}\n\n", b"data: {}\n\n"]

    async def chunk(self) -> bytes:
        if len(self._left) == 1:
            await asyncio.sleep(5)
        return self._left.pop(0) if self._left else b""

    def close(self) -> None:
        pass


async def test_the_deadline_passing_while_the_client_is_slow_ends_the_stream_in_band():
    """The deadline is the relay's to report (an in-band error): a timer around the relay's
    loop fired while it waited at a ``yield`` and cancelled the client's writer instead."""
    ended: list[float] = []
    leg: Any = SimpleNamespace(
        decode=SimpleNamespace(open_streams=set(), name="d0"), route="local",
        first_byte=lambda now: None, frames=lambda now, n: None, ended=ended.append,
        req=SimpleNamespace(spans=None), trace=SimpleNamespace(t_start=time.perf_counter()))
    stream = EngineStream("d0", _Response(), idle_s=30.0)  # type: ignore[arg-type]
    deadline = asyncio.get_running_loop().time() + 0.05
    got = []
    async for item in relay(leg, stream, deadline, ProxyMetrics(), None):
        got.append(item)
        await asyncio.sleep(0.1)  # the client takes its time with each write
    assert isinstance(got[-1], RequestDeadline) and ended
