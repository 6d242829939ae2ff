"""The proxy app end to end against in-process fake engines: routing, relay, fallbacks, errors.

The app runs in-process (httpx's ASGI transport, lifespan entered by hand); the fake engines are
real aiohttp servers on loopback ports, so the proxy's own HTTP client and pool are exercised.
Hangs are gated by events; the only waits are the proxy's own (short) deadlines under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.fake_engine import DONE_FRAME, TOO_LONG, FakeEngine
from harness.live_proxy import SETTLE_S, proxy_config
from proxy.app import create_app
from transport import kv_params
from transport.kv_params import prefill_request_params

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
#: A deadline the fakes are made to miss (they hang on an event); everything else gets plenty.
SHORT_S = 0.2


def chat_body(**extra: Any) -> dict[str, Any]:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello to the whole wide world, please."},
        ],
        "max_tokens": 16,
        "temperature": 0.0,
    }
    return body | extra


def completions_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "The capital of France is", "max_tokens": 8} | extra


BODIES = {CHAT_PATH: chat_body, COMPLETIONS_PATH: completions_body}


# --- harness ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def proxy(
    prefill: FakeEngine | None, decode: FakeEngine, **overrides: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """Run the proxy app (lifespan included) in front of the fakes; yield a client for it."""
    # Short deadlines, so the timeout tests finish quickly.
    deadlines = {"prefill_deadline_s": 10.0, "headers_deadline_s": 10.0,
                 "idle_deadline_s": 10.0, "total_deadline_s": 30.0}
    app = create_app(proxy_config(prefill, decode, **(deadlines | overrides)))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            yield client


async def metric(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    """The value of one sample from the proxy's /metrics text (0 when not exported yet)."""
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def assert_error(resp: httpx.Response, status: int, type_: str, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    assert "Traceback" not in resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type_
    assert error["param"] == param
    return error


def sse_events(raw: bytes) -> list[bytes]:
    """The payloads of an SSE body's ``data:`` events, in order."""
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") for e in events), raw
    return [e[len(b"data: "):] for e in events]


def client_view(sent: bytes) -> bytes:
    """What a client that did not ask for token ids gets of the bytes an engine sent: each
    event without the ``token_ids`` the proxy asked for (events that carried nothing else are
    left out); events with none, byte for byte."""
    out = []
    for event in sent.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            out.append(event + b"\n\n" if event else b"")
            continue
        obj = json.loads(event[6:])
        changed = obj.pop("prompt_token_ids", None) is not None
        for choice in obj.get("choices", []):
            changed = choice.pop("prompt_token_ids", None) is not None or changed
            changed = choice.pop("token_ids", None) is not None or changed
        out.append(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
                   if changed else event + b"\n\n")
    return b"".join(out)


def split_in_band_error(body: bytes) -> tuple[bytes, dict[str, Any]]:
    """Split a stream that ended in an in-band error into (relayed bytes, the error object).

    Checks the ending is exactly one ``data: {"error": ...}`` event and then ``data: [DONE]``.
    """
    assert body.endswith(DONE_FRAME), body
    error_at = body.rindex(b"data: ", 0, len(body) - len(DONE_FRAME))
    relayed, error_frame = body[:error_at], body[error_at : -len(DONE_FRAME)]
    (payload,) = sse_events(error_frame)
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert b"Traceback" not in body
    return relayed, error


def without(body: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in keys}


# --- the disaggregated path ------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
async def test_pd_happy_path(prefill: FakeEngine, decode: FakeEngine, path: str) -> None:
    body = BODIES[path]()
    async with proxy(prefill, decode) as client:
        resp = await client.post(path, json=body, headers={"x-request-id": "req-happy-1"})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-pd-route"] == "disaggregated"
        assert resp.headers["x-request-id"] == "req-happy-1"
        assert resp.json()["x_fake_received_kv_transfer_params"] is True

        assert await metric(client, "pd_decisions_total", route="disaggregated",
                            reason="policy_disaggregate") == 1
        endpoint = "chat" if path == CHAT_PATH else "completions"
        assert await metric(client, "pd_requests_total", endpoint=endpoint,
                            route="disaggregated", status="200") == 1
        for reason in ("prefill_error", "prefill_unreachable", "prefill_timeout", "bad_handoff"):
            assert await metric(client, "pd_fallbacks_total", reason=reason) == 0

    # Each fake played exactly one role, once.
    assert len(prefill.prefill_requests) == 1 and not prefill.decode_requests
    assert len(decode.decode_requests) == 1 and not decode.prefill_requests
    p, d = prefill.prefill_requests[0], decode.decode_requests[0]
    assert p.path == d.path == path
    assert p.request_id == d.request_id == "req-happy-1"

    # Prefill: the client's request cut down to one token, no stream, ids returned.
    assert p.body["max_tokens"] == 1
    assert p.body["stream"] is False
    assert p.body["return_token_ids"] is True
    assert "stream_options" not in p.body
    assert p.body["kv_transfer_params"] == prefill_request_params()
    assert without(p.body, "max_tokens", "stream", "return_token_ids", "kv_transfer_params") == \
        without(body, "max_tokens")

    # Decode: the client's body untouched, plus the prefill's params and prompt ids, and the
    # time after which the decode engine must not read the blocks: 80 % of the 30 s lease away.
    assert without(d.body, "kv_transfer_params") == body
    sent = dict(d.body["kv_transfer_params"])
    read_by = sent.pop(kv_params.READ_BY_KEY)
    assert 0.8 * 30 - 5 < read_by - time.time() <= 0.8 * 30
    expected = prefill.handoffs[0] | {"prompt_token_ids": prefill.handoff_prompt_ids[0]}
    assert sent == expected
    assert d.body["kv_transfer_params"]["x_fake_engine_extra"] == {"kept": True}


async def test_request_id_is_generated_when_absent(prefill: FakeEngine, decode: FakeEngine) -> None:
    async with proxy(prefill, decode) as client:
        resp = await client.post(CHAT_PATH, json=chat_body())
    assert resp.status_code == 200
    rid = resp.headers["x-request-id"]
    assert rid
    assert prefill.prefill_requests[0].request_id == decode.decode_requests[0].request_id == rid


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
async def test_stream_relays_engine_bytes_exactly(
    prefill: FakeEngine, decode: FakeEngine, path: str
) -> None:
    body = BODIES[path](stream=True, stream_options={"include_usage": True})
    async with proxy(prefill, decode) as client:
        resp = await client.post(path, json=body, headers={"x-request-id": "req-stream"})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-pd-route"] == "disaggregated"
    assert resp.headers["x-request-id"] == "req-stream"
    assert len(decode.sent_streams) == 1
    assert b"token_ids" in decode.sent_streams[0] and b"token_ids" not in resp.content
    assert resp.content == client_view(decode.sent_streams[0])
    assert resp.content.endswith(DONE_FRAME)
    # The prefill leg never streams; the decode leg gets the client's stream settings.
    p, d = prefill.prefill_requests[0], decode.decode_requests[0]
    assert p.body["stream"] is False and "stream_options" not in p.body
    # ...and is asked for the token ids a continuation on another engine would need.
    assert without(d.body, "kv_transfer_params", "return_token_ids") == body
    assert d.body["return_token_ids"] is True


async def test_a_stream_that_asks_for_token_ids_gets_the_engines_bytes_exactly(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    body = completions_body(stream=True, return_token_ids=True)
    async with proxy(prefill, decode) as client:
        resp = await client.post(COMPLETIONS_PATH, json=body)
    assert resp.status_code == 200 and b'"token_ids":[50000]' in resp.content
    assert resp.content == decode.sent_streams[0]


# --- prefill failures: serve locally and count why -------------------------------------------


async def assert_served_locally(
    client: httpx.AsyncClient, decode: FakeEngine, reason: str
) -> None:
    resp = await client.post(CHAT_PATH, json=chat_body(), headers={"x-request-id": "req-fb"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-pd-route"] == "local"
    assert resp.json()["x_fake_received_kv_transfer_params"] is False
    assert len(decode.decode_requests) == 1
    d = decode.decode_requests[0]
    assert d.body == chat_body() and d.request_id == "req-fb"
    assert await metric(client, "pd_fallbacks_total", reason=reason) == 1
    assert await metric(client, "pd_requests_total", endpoint="chat", route="local",
                        status="200") == 1


@pytest.mark.parametrize("prompt", [["The capital of France is", "Two plus two is"],
                                    [[1, 2, 3], [4, 5, 6]]])
async def test_a_batch_of_prompts_is_computed_where_it_is_decoded(
    prefill: FakeEngine, decode: FakeEngine, prompt: list
) -> None:
    """vLLM's prefill reply carries the first prompt's hand-off only: the decode engine would
    read that prompt's blocks for every prompt of the batch."""
    async with proxy(prefill, decode) as client:  # (policy: always disaggregate)
        resp = await client.post(COMPLETIONS_PATH, json=completions_body(prompt=prompt))
        assert resp.status_code == 200 and resp.headers["x-pd-route"] == "local"
        one = await client.post(COMPLETIONS_PATH, json=completions_body(prompt=prompt[:1]))
        assert one.headers["x-pd-route"] == "disaggregated"
    assert len(prefill.prefill_requests) == 1
    assert "kv_transfer_params" not in decode.decode_requests[0].body


async def test_prefill_500_falls_back(prefill: FakeEngine, decode: FakeEngine) -> None:
    prefill.prefill_status = 500
    async with proxy(prefill, decode) as client:
        await assert_served_locally(client, decode, "prefill_error")
    assert len(prefill.prefill_requests) == 1


async def test_prefill_unreachable_falls_back_and_is_marked_down(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    async with proxy(prefill, decode) as client:
        # The start-up probe saw it up (the health loop's next round is an hour away here).
        await prefill.wait_for_health_checks(1)
        await prefill.stop()  # connection refused from now on
        await assert_served_locally(client, decode, "prefill_unreachable")
        # Marked down: the next request is routed locally without trying it again.
        resp = await client.post(CHAT_PATH, json=chat_body())
        assert resp.headers["x-pd-route"] == "local"
        assert await metric(client, "pd_decisions_total", route="local",
                            reason="prefill_unavailable") == 1
        assert await metric(client, "pd_fallbacks_total", reason="prefill_unreachable") == 1
        assert await metric(client, "pd_engine_up", role="prefill", engine="prefill-0") == 0


async def test_prefill_timeout_falls_back(prefill: FakeEngine, decode: FakeEngine) -> None:
    prefill.prefill_gate = gate = asyncio.Event()
    async with proxy(prefill, decode, prefill_deadline_s=SHORT_S) as client:
        await assert_served_locally(client, decode, "prefill_timeout")
        # ...and closed the prefill at once (not when the proxy shuts down).
        await asyncio.wait_for(prefill.prefill_aborted.wait(), SETTLE_S)
        assert prefill.prefill_aborts == 1
    assert not gate.is_set()  # it really was still hanging when the proxy gave up
    assert len(prefill.prefill_requests) == 1


BAD_HANDOFFS = {
    "no params": json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode(),
    "params without blocks": json.dumps({
        "prompt_token_ids": [1, 2],
        "kv_transfer_params": {"remote_engine_id": "e", "remote_request_id": "r",
                               "remote_host": "h", "remote_port": 1},
    }).encode(),
    # Complete, but not what vLLM's NixlConnector writes: never reaches a decode engine.
    "host a list": json.dumps({
        "prompt_token_ids": [1, 2],
        "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "e",
                               "remote_request_id": "r", "remote_host": ["h", "169.254.169.254"],
                               "remote_port": 1, "remote_block_ids": [[1]]},
    }).encode(),
    "json array": b"[]",
    "json null": b"null",
    "not json": b"<html>oops</html>",
}


@pytest.mark.parametrize("raw", BAD_HANDOFFS.values(), ids=BAD_HANDOFFS.keys())
async def test_bad_handoff_falls_back(prefill: FakeEngine, decode: FakeEngine, raw: bytes) -> None:
    prefill.prefill_raw_reply = raw
    async with proxy(prefill, decode) as client:
        await assert_served_locally(client, decode, "bad_handoff")


async def test_prefill_400_is_the_clients_error(prefill: FakeEngine, decode: FakeEngine) -> None:
    body = chat_body(messages=[{"role": "user", "content": f"{TOO_LONG} " * 50}])
    async with proxy(prefill, decode) as client:
        resp = await client.post(CHAT_PATH, json=body, headers={"x-request-id": "req-400"})
        error = assert_error(resp, 400, "invalid_request_error")
        assert "maximum context length" in error["message"]  # the engine's words, passed on
        assert resp.headers["x-request-id"] == "req-400"
        for reason in ("prefill_error", "bad_handoff"):
            assert await metric(client, "pd_fallbacks_total", reason=reason) == 0
    assert len(prefill.prefill_requests) == 1
    assert not decode.completion_requests


async def test_decode_400_is_the_clients_error(prefill: FakeEngine, decode: FakeEngine) -> None:
    body = completions_body(prompt=f"{TOO_LONG} please")
    async with proxy(prefill, decode, policy="local") as client:
        resp = await client.post(COMPLETIONS_PATH, json=body)
    error = assert_error(resp, 400, "invalid_request_error")
    assert "maximum context length" in error["message"]
    assert not prefill.completion_requests
    assert len(decode.decode_requests) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_decode_refusing_the_handoff_computes_the_prompt(
    prefill: FakeEngine, decode: FakeEngine, stream: bool
) -> None:
    """A decode 4xx naming the transfer params (vLLM refusing the prefill's prompt ids, say) is
    the proxy's doing, never the client's: the same engine computes the prompt instead."""
    decode.decode_refuses_handoff_ids = True
    async with proxy(prefill, decode) as client:
        resp = await client.post(CHAT_PATH, json=chat_body(stream=stream))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-pd-route"] == "local"
        assert await metric(client, "pd_fallbacks_total", reason="handoff_refused") == 1
    first, second = decode.decode_requests
    assert first.body["kv_transfer_params"]["prompt_token_ids"] == prefill.handoff_prompt_ids[0]
    assert "kv_transfer_params" not in second.body  # the client's body, no hand-off
    assert without(second.body, "return_token_ids") == chat_body(stream=stream)
    assert len(prefill.prefill_requests) == 1


async def test_a_decode_400_to_a_handoff_not_naming_it_is_the_clients_error(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    """What the prefill accepted the decode may still refuse (the client's ``max_tokens`` past
    the context, say): the client's error, relayed, and no second engine call."""
    decode.decode_status = 400
    async with proxy(prefill, decode) as client:
        resp = await client.post(CHAT_PATH, json=chat_body())
        assert_error(resp, 400, "invalid_request_error")
        assert await metric(client, "pd_fallbacks_total", reason="handoff_refused") == 0
    assert len(decode.decode_requests) == 1
    assert "kv_transfer_params" in decode.decode_requests[0].body


# --- decode failures --------------------------------------------------------------------------


async def test_decode_drop_mid_stream_ends_with_in_band_error(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    decode.decode_drop_after_frames = 2
    async with proxy(prefill, decode) as client:
        resp = await client.post(CHAT_PATH, json=chat_body(stream=True))
        assert resp.status_code == 200
        assert await metric(client, "pd_stream_errors_total", reason="decode_lost") == 1
    sent = decode.sent_streams[0]
    assert sent.count(b"\n\n") == 2
    # Whatever the proxy read before the drop is relayed unchanged. (When the frames and the
    # close arrive together, aiohttp raises the payload error before handing out buffered bytes,
    # so the relayed part may be shorter than what the engine wrote, down to nothing.)
    relayed, error = split_in_band_error(resp.content)
    assert client_view(sent).startswith(relayed)
    assert error["type"] == "upstream_error"


async def test_decode_stall_mid_stream_ends_with_in_band_timeout(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    decode.decode_gate = asyncio.Event()
    decode.decode_gate_after_frames = 2
    async with proxy(prefill, decode, idle_deadline_s=SHORT_S) as client:
        resp = await client.post(CHAT_PATH, json=chat_body(stream=True))
        assert resp.status_code == 200
        assert await metric(client, "pd_stream_errors_total", reason="decode_timeout") == 1
        # The stalled request is closed at once (not when the proxy shuts down).
        await asyncio.wait_for(decode.decode_aborted.wait(), SETTLE_S)
        assert decode.decode_aborts == 1
    relayed, error = split_in_band_error(resp.content)
    assert error["type"] == "timeout_error"
    # Normally both frames written before the stall; only a prefix if the host is very slow.
    assert client_view(decode.sent_streams[0]).startswith(relayed)
    assert decode.sent_streams[0].count(b"\n\n") == 2


async def test_decode_never_answers_a_stream_is_a_504(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    decode.decode_gate = gate = asyncio.Event()
    async with proxy(prefill, decode, headers_deadline_s=SHORT_S) as client:
        resp = await client.post(CHAT_PATH, json=chat_body(stream=True),
                                 headers={"x-request-id": "req-504"})
        # The stalled request is closed at once (not when the proxy shuts down) and not
        # retried; in its place a one-token read of the hand-off frees the prefill's blocks
        # once the engine answers (vLLM may drop the closed request before it sees them).
        await asyncio.wait_for(decode.decode_aborted.wait(), SETTLE_S)
        await asyncio.wait_for(decode.wait_for_requests(2), SETTLE_S)
        assert decode.decode_aborts == 1
        original, release = decode.decode_requests
        assert release.body["max_tokens"] == 1 and release.body["stream"] is False
        assert release.body["kv_transfer_params"] == original.body["kv_transfer_params"]
        gate.set()
    assert_error(resp, 504, "timeout_error")
    assert resp.headers["x-request-id"] == "req-504"
    assert len(decode.decode_requests) == 2


async def test_decode_never_answers_a_whole_reply_is_a_504_at_the_total_deadline(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    """A whole reply's headers come with its last token: its time is the request's deadline.
    It is closed then (vLLM aborts it, and frees a hand-off it had not yet pulled); no read of
    the hand-off follows, as its KV may have been pulled and freed long before."""
    decode.decode_gate = gate = asyncio.Event()
    async with proxy(prefill, decode, headers_deadline_s=SHORT_S,
                     total_deadline_s=4 * SHORT_S) as client:
        t0 = time.monotonic()
        resp = await client.post(CHAT_PATH, json=chat_body(), headers={"x-request-id": "r"})
        elapsed = time.monotonic() - t0
        await asyncio.wait_for(decode.decode_aborted.wait(), SETTLE_S)
        gate.set()
        await asyncio.sleep(0.1)
    assert_error(resp, 504, "timeout_error")
    assert elapsed >= 4 * SHORT_S - 0.05, elapsed
    assert len(decode.decode_requests) == 1


# --- requests refused at the edge -------------------------------------------------------------


SMUGGLED = {"do_remote_prefill": True, "remote_host": "10.1.2.3", "remote_port": 22,
            "remote_block_ids": [[1]]}


@pytest.mark.parametrize(("fields", "param"), [
    ({"kv_transfer_params": SMUGGLED}, "kv_transfer_params"),
    ({"ec_transfer_params": {}}, "ec_transfer_params"),
    # vLLM takes them from its extra_args too; "" there kills the engine core (NIXL's
    # on_new_request calls .get on it)
    ({"vllm_xargs": {"kv_transfer_params": ""}}, "vllm_xargs"),
], ids=["top-level", "encoder cache", "in vllm_xargs"])
async def test_client_kv_transfer_params_are_refused(
    prefill: FakeEngine, decode: FakeEngine, fields: dict, param: str
) -> None:
    body = chat_body(**fields)
    async with proxy(prefill, decode) as client:
        resp = await client.post(CHAT_PATH, json=body)
        assert_error(resp, 400, "invalid_request_error", param)
        assert await metric(client, "pd_rejected_total", type="invalid_request_error") == 1
    assert not prefill.completion_requests
    assert not decode.completion_requests


EDGE_ERRORS = [
    ("malformed json", b'{"model": "m", "messages": [', "application/json", 400,
     "invalid_request_error", None),
    ("wrong content type", json.dumps(chat_body()).encode(), "text/plain", 415,
     "invalid_request_error", None),
    ("too large", json.dumps(chat_body(pad="x" * 2048)).encode(), "application/json", 413,
     "invalid_request_error", None),
    ("unknown model", json.dumps(chat_body(model="gpt-4")).encode(), "application/json", 404,
     "not_found_error", "model"),
    ("n=2", json.dumps(chat_body(n=2)).encode(), "application/json", 400,
     "invalid_request_error", "n"),
]


@pytest.mark.parametrize(
    ("raw", "content_type", "status", "type_", "param"),
    [e[1:] for e in EDGE_ERRORS],
    ids=[e[0] for e in EDGE_ERRORS],
)
async def test_edge_errors_never_reach_an_engine(
    prefill: FakeEngine, decode: FakeEngine, raw: bytes, content_type: str, status: int,
    type_: str, param: str | None,
) -> None:
    async with proxy(prefill, decode, body_limit_bytes=1024) as client:
        resp = await client.post(CHAT_PATH, content=raw, headers={"content-type": content_type,
                                                                  "x-request-id": "req-edge"})
    assert_error(resp, status, type_, param)
    assert resp.headers["x-request-id"] == "req-edge"
    assert not prefill.completion_requests and not decode.completion_requests


async def test_unknown_route_and_wrong_method_get_openai_errors(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    async with proxy(prefill, decode) as client:
        resp = await client.post("/v1/embeddings", json={"model": "m", "input": "x"})
        assert_error(resp, 404, "not_found_error")
        assert "/v1/embeddings" in resp.json()["error"]["message"]
        resp = await client.get(CHAT_PATH)
        assert_error(resp, 405, "invalid_request_error")
        assert resp.headers["allow"] == "POST"
    assert not prefill.completion_requests and not decode.completion_requests


async def test_a_bug_on_the_completion_path_is_an_openai_500_without_a_traceback(
    prefill: FakeEngine, decode: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion routes are served ahead of Starlette's error middleware
    (``proxy/hot_paths.py``): what escapes them still becomes the OpenAI-style 500."""
    from proxy import app as app_module

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module, "check_request", broken)
    async with proxy(prefill, decode) as client:
        for path, body in BODIES.items():
            resp = await client.post(path, json=body())
            assert_error(resp, 500, "internal_error")
            assert "a bug" not in resp.text
    assert not prefill.completion_requests and not decode.completion_requests


async def test_a_bug_while_serving_is_a_500_not_an_engines_502(
    prefill: FakeEngine, decode: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No engine failed: the 502 ``upstream_error`` would send an operator after one."""
    from proxy.orchestrator import Orchestrator

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise OverflowError("a bug")

    monkeypatch.setattr(Orchestrator, "serve", broken)
    async with proxy(prefill, decode) as client:
        resp = await client.post(CHAT_PATH, json=chat_body())
    assert_error(resp, 500, "internal_error")
    assert "a bug" not in resp.text


# --- auth, models, health ---------------------------------------------------------------------


async def test_api_key(prefill: FakeEngine, decode: FakeEngine) -> None:
    async with proxy(prefill, decode, api_key="sekret") as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekret"},
                        {"authorization": "Bearer sekret2"}, {"authorization": "Basic sekret"},
                        {"authorization": "Bearer"}):
            resp = await client.post(CHAT_PATH, json=chat_body(), headers=headers)
            assert_error(resp, 401, "authentication_error")
            resp = await client.get("/v1/models", headers=headers)
            assert_error(resp, 401, "authentication_error")
        assert not prefill.completion_requests and not decode.completion_requests

        good = {"authorization": "Bearer sekret"}
        resp = await client.post(CHAT_PATH, json=chat_body(), headers=good)
        assert resp.status_code == 200
        assert (await client.get("/v1/models", headers=good)).status_code == 200
        for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 9110)
            resp = await client.get("/v1/models", headers={"authorization": f"{scheme} sekret"})
            assert resp.status_code == 200
        # Health and metrics stay public by default.
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200


async def test_private_health_needs_the_key(prefill: FakeEngine, decode: FakeEngine) -> None:
    async with proxy(prefill, decode, api_key="sekret", public_health=False) as client:
        assert_error(await client.get("/health"), 401, "authentication_error")
        assert_error(await client.get("/metrics"), 401, "authentication_error")
        good = {"authorization": "Bearer sekret"}
        assert (await client.get("/health", headers=good)).status_code == 200
        assert (await client.get("/metrics", headers=good)).status_code == 200


async def test_models_lists_served_names(prefill: FakeEngine, decode: FakeEngine) -> None:
    async with proxy(prefill, decode, served_model_names=("m", "m-alias")) as client:
        resp = await client.get("/v1/models")
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["m", "m-alias"]
    assert all(m["object"] == "model" for m in body["data"])


async def test_health_ok_when_engines_are_up(prefill: FakeEngine, decode: FakeEngine) -> None:
    async with proxy(prefill, decode) as client:
        resp = await client.get("/health")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok"}


async def test_health_503_when_decode_is_down(prefill: FakeEngine, decode: FakeEngine) -> None:
    await decode.stop()  # its port now refuses connections
    async with proxy(prefill, decode) as client:
        assert_error(await client.get("/health"), 503, "service_unavailable")
        resp = await client.post(CHAT_PATH, json=chat_body())
        assert_error(resp, 503, "service_unavailable")
        assert await metric(client, "pd_engine_up", role="decode", engine="decode-0") == 0
    assert not prefill.completion_requests


async def test_health_503_when_prefill_is_down(prefill: FakeEngine, decode: FakeEngine) -> None:
    """A configured prefill that is down makes the proxy unready (requests still fall back)."""
    await prefill.stop()
    async with proxy(prefill, decode) as client:
        assert_error(await client.get("/health"), 503, "service_unavailable")
        resp = await client.post(CHAT_PATH, json=chat_body())
        assert resp.status_code == 200 and resp.headers["x-pd-route"] == "local"


@pytest.mark.parametrize("policy", ["local", "disaggregate"])
async def test_decode_only_proxy(decode: FakeEngine, policy: str) -> None:
    """No prefill engines configured: every request is served locally, and the proxy is ready."""
    async with proxy(None, decode, policy=policy) as client:
        resp = await client.get("/health")
        assert resp.status_code == 200, resp.text
        resp = await client.post(CHAT_PATH, json=chat_body())
        assert resp.status_code == 200 and resp.headers["x-pd-route"] == "local"
        assert resp.json()["x_fake_received_kv_transfer_params"] is False
        assert await metric(client, "pd_decisions_total", route="local",
                            reason="prefill_unavailable") == 1


async def test_dashboard_series_exist_from_the_start_and_pairs_are_measured(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    """Labelled counters a dashboard selects are 0 before their first event (not absent); a
    streamed P/D request records its pair's hand-over and KV bytes, and its inter-token gaps."""
    decode.decode_frame_interval_s = 0.01
    body = BODIES[CHAT_PATH](stream=True)
    async with proxy(prefill, decode, kv_bytes_per_token=1000) as client:
        text = (await client.get("/metrics")).text
        for series in ('pd_fallbacks_total{reason="prefill_timeout"} 0.0',
                       'pd_stream_errors_total{reason="decode_lost"} 0.0',
                       'pd_rejected_total{type="overloaded_error"} 0.0',
                       'pd_client_disconnects_total{stage="streaming"} 0.0'):
            assert series in text, series
        resp = await client.post(CHAT_PATH, json=body)
        assert resp.status_code == 200 and resp.headers["x-pd-route"] == "disaggregated"
        pair = {"prefill": "prefill-0", "decode": "decode-0"}
        assert await metric(client, "pd_handover_seconds_count", **pair) == 1
        prompt = prefill.prefill_requests[0]
        moved = await metric(client, "pd_kv_moved_bytes_total", **pair)
        assert moved > 0 and moved % 1000 == 0, (moved, prompt)
        tokens = resp.content.count(b"data: ") - 2  # less the role event and [DONE]
        # A gap per chunk after the first token's (fewer when chunks coalesce); the role event
        # and [DONE] are no tokens and make no gap (they made two once).
        gaps = await metric(client, "pd_itl_seconds_count", route="disaggregated")
        assert 1 <= gaps <= tokens - 1, (gaps, tokens)


async def test_traces_are_off_unless_an_endpoint_is_set(prefill: FakeEngine,
                                                          decode: FakeEngine) -> None:
    app = create_app(proxy_config(prefill, decode))
    async with app.router.lifespan_context(app):
        assert app.state.pd.tracing is None  # no provider, no exporter
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            assert (await client.post(CHAT_PATH, json=BODIES[CHAT_PATH]())).status_code == 200
    assert "traceparent" not in decode.decode_requests[0].headers


async def test_a_traced_request_sends_its_span_context_to_both_engines(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from proxy.tracing import Tracing

    exported = InMemorySpanExporter()
    app = create_app(proxy_config(prefill, decode))
    async with app.router.lifespan_context(app):
        app.state.pd.tracing = Tracing("unused", exporter=exported)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            resp = await client.post(CHAT_PATH, json=BODIES[CHAT_PATH](stream=True),
                                     headers={"x-request-id": "t1"})
            assert resp.status_code == 200
        app.state.pd.tracing.shutdown()
    spans = {s.name: s for s in exported.get_finished_spans()}
    root = spans["pdserve.request"]
    assert root.attributes["pd.route"] == "disaggregated"
    assert {s.context.trace_id for s in spans.values()} == {root.context.trace_id}
    for engine, name in ((prefill.prefill_requests[0], "prefill"),
                         (decode.decode_requests[0], "decode")):
        _, trace_id, span_id, _ = engine.headers["traceparent"].split("-")
        assert int(trace_id, 16) == root.context.trace_id
        assert int(span_id, 16) == spans[name].context.span_id


async def test_a_hung_prefill_does_not_run_a_request_past_its_deadline(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    """The prefill's own deadline (10 s here) is cut to what is left of the request's (0.6 s),
    and no local prefill follows that the deadline has no room for."""
    prefill.prefill_gate = gate = asyncio.Event()
    async with proxy(prefill, decode, headers_deadline_s=0.6, total_deadline_s=0.6) as client:
        t0 = time.monotonic()
        resp = await client.post(CHAT_PATH, json=chat_body(stream=True))
        elapsed = time.monotonic() - t0
        gate.set()
    assert_error(resp, 504, "timeout_error")
    assert elapsed < 3, elapsed
    assert not decode.decode_requests
