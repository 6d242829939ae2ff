"""Any request, one promise: a valid answer, or a 4xx with an OpenAI-style JSON error. Never a
5xx, never a plain-text error, never a traceback. Property-based (hypothesis) over bodies
(valid ones bent field by field, arbitrary JSON, raw bytes, deep nesting), content types and
headers, sent over real sockets to the proxy app under uvicorn in front of fake engines.

The examples are shrunk and printed on failure; the database is off, so every run starts
from the same seed-free search (CI and a laptop find the same classes of holes)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.fake_engine import FakeEngine
from harness.live_proxy import live_proxy, proxy_config

FUZZ = settings(max_examples=250, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
PATHS = ("/v1/chat/completions", "/v1/completions")
KEYS = ("model", "messages", "prompt", "stream", "max_tokens", "max_completion_tokens",
        "temperature", "top_p", "n", "seed", "stop", "logprobs", "stream_options", "tools",
        "tool_choice", "response_format", "slo", "kv_transfer_params", "role", "content",
        "type", "text", "name", "user", "echo", "prompt_token_ids")


@pytest.fixture(scope="module")
def proxy_url() -> Iterator[str]:
    """Fake engines and the live proxy on their own event loop, in a thread, for the module."""
    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}
    started = threading.Event()

    async def serve() -> None:
        prefill, decode = FakeEngine("prefill"), FakeEngine("decode")
        await prefill.start()
        await decode.start()
        try:
            async with live_proxy(proxy_config(prefill, decode, max_inflight=64)) as lp:
                ready["url"], ready["stop"] = lp.url, asyncio.Event()
                started.set()
                await ready["stop"].wait()
        finally:
            await prefill.stop()
            await decode.stop()
            started.set()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(60) and "url" in ready, "the proxy did not start"
    try:
        yield ready["url"]
    finally:
        loop.call_soon_threadsafe(ready["stop"].set)
        thread.join(30)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@st.composite
def bent_bodies(draw) -> dict[str, Any]:
    """A valid chat or completions body with a few fields replaced, added or removed."""
    chat = draw(st.booleans())
    body: dict[str, Any] = ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                            if chat else {"model": "m", "prompt": "hi"})
    body["max_tokens"] = 4
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=3)):
        if draw(st.booleans()):
            body[key] = draw(json_values)
        else:
            body.pop(key, None)
    if chat and draw(st.booleans()):  # bend a message rather than the list
        body["messages"] = [draw(st.dictionaries(st.sampled_from(KEYS), json_values,
                                                 max_size=4))]
    return body


def nested(depth: int, open_: str, close: str) -> bytes:
    return ('{"model": "m", "prompt": ' + open_ * depth + "1" + close * depth + "}").encode()


raw_bodies = (st.binary(max_size=200)
              | st.integers(1, 5000).map(lambda d: nested(d, "[", "]"))
              | st.integers(1, 5000).map(lambda d: nested(d, '{"a": ', "}"))
              | json_values.map(lambda v: json.dumps(v).encode()))
content_types = st.sampled_from([b"application/json", b"application/json; charset=utf-8",
                                 b"text/plain", b"application/x-www-form-urlencoded", b"",
                                 b"application/json; charset=latin-1"]) | st.binary(max_size=20)
headers = st.dictionaries(
    st.sampled_from(["authorization", "x-request-id", "x-pd-route", "accept",
                     "content-encoding", "x-pd-slo"]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30).map(str.strip),
    max_size=3)  # (a header value with outer spaces is the client library's error, not ours)


def check(r: httpx.Response, stream: bool) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    assert "Traceback" not in r.text
    if r.status_code == 200:
        if stream:
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        else:
            assert "choices" in r.json()
        return
    assert r.headers["content-type"].startswith("application/json"), r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def send(url: str, path: str, content: bytes, ctype: str, extra: dict[str, str]
         ) -> httpx.Response:
    hdrs = dict(extra)
    if ctype:
        hdrs["content-type"] = ctype
    with httpx.Client(timeout=30) as c:
        return c.post(url + path, content=content, headers=hdrs)


@FUZZ
@given(path=st.sampled_from(PATHS), body=bent_bodies(), extra=headers)
def test_bent_bodies_get_an_answer_or_an_openai_style_4xx(proxy_url, path, body, extra):
    r = send(proxy_url, path, json.dumps(body).encode(), "application/json", extra)
    check(r, stream=body.get("stream") is True)


def send_raw(url: str, path: str, content: bytes, ctype: bytes) -> httpx.Response:
    """One request written byte for byte (a header value no client library would send)."""
    host, port = url.removeprefix("http://").split(":")
    head = (b"POST " + path.encode() + b" HTTP/1.1\r\nhost: " + host.encode()
            + b"\r\ncontent-type: " + ctype + b"\r\ncontent-length: "
            + str(len(content)).encode() + b"\r\nconnection: close\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + content)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    raw_headers, _, body = rest.partition(b"\r\n\r\n")
    hdrs = [tuple(line.decode("latin-1").split(":", 1)) for line in raw_headers.split(b"\r\n")]
    if any(k.lower() == "transfer-encoding" and "chunked" in v for k, v in hdrs):
        body = dechunk(body)
    return httpx.Response(int(status_line.split()[1]), headers=[(k, v.strip()) for k, v in hdrs],
                          content=body)


def dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, data = data.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            break
        out, data = out + data[:n], data[n + 2:]
    return out


@FUZZ
@given(path=st.sampled_from(PATHS), content=raw_bodies, ctype=content_types)
def test_any_bytes_get_an_answer_or_an_openai_style_4xx(proxy_url, path, content, ctype):
    r = send_raw(proxy_url, path, content, ctype)
    stream = False
    try:
        parsed = json.loads(content)
        stream = isinstance(parsed, dict) and parsed.get("stream") is True
    except (ValueError, RecursionError):
        pass
    check(r, stream)
