"""A lean fake of vLLM's OpenAI server for benchmarks that send long prompts.

Like ``tests/proxy/fake_engine.py`` it plays either role per request (a body whose
``kv_transfer_params`` asks for a remote decode is a prefill), but it is built to stay off its
own critical path: bodies are decoded with msgspec into just the fields it reads (the prompt and
a decode's ``kv_transfer_params`` are skipped, not parsed), and the prompt token ids of a
prefill reply are encoded once per length. So a stream it serves is not delayed by a long prompt
it is handed at the same time: what a benchmark measures is the proxy's doing.

Per-request knobs in the body (the proxy passes unknown fields through): ``x_prompt_tokens``
(how many ids a prefill returns; default: one per four characters of the prompt) and
``x_frame_interval_s`` (pause between stream frames). A stream carries ``max_tokens`` frames.

Run: ``python -m benchmarks.lean_engine --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools

import msgspec
from aiohttp import web


class _Message(msgspec.Struct):
    content: msgspec.Raw = msgspec.Raw(b'""')


class _Body(msgspec.Struct):
    stream: bool = False
    max_tokens: int = 16
    messages: list[_Message] | None = None
    prompt: msgspec.Raw = msgspec.Raw(b'""')
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")
    x_prompt_tokens: int | None = None
    x_frame_interval_s: float = 0.0


_decode_body = msgspec.json.Decoder(_Body).decode
_PREFILL_MARK = b'"do_remote_decode":true'


@functools.lru_cache(maxsize=16)
def _ids_json(n: int) -> bytes:
    return msgspec.json.encode(list(range(1000, 1000 + n)))


def _prompt_tokens(body: _Body) -> int:
    if body.x_prompt_tokens is not None:
        return body.x_prompt_tokens
    chars = (sum(len(m.content) for m in body.messages) if body.messages is not None
             else len(body.prompt))
    return max(1, chars // 4)


async def _health(_request: web.Request) -> web.Response:
    return web.Response()


async def _completion(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    body = _decode_body(raw)
    chat = request.path.endswith("/chat/completions")
    if _PREFILL_MARK in bytes(body.kv_transfer_params).replace(b" ", b""):
        return _prefill(body, chat)
    return await _decode(request, body, chat)


def _prefill(body: _Body, chat: bool) -> web.Response:
    n = _prompt_tokens(body)
    params = msgspec.json.encode({
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
        "remote_engine_id": "lean", "remote_request_id": "lean-0", "remote_host": "127.0.0.1",
        "remote_port": 5600, "tp_size": 1, "remote_num_tokens": n,
        "remote_prefill_cached_tokens": 0})
    choice = (b'{"index":0,"message":{"role":"assistant","content":"X"},"finish_reason":"length"}'
              if chat else b'{"index":0,"text":"X","finish_reason":"length"}')
    ids = _ids_json(n)
    if chat:
        out = (b'{"id":"lean","object":"chat.completion","choices":[' + choice
               + b'],"prompt_token_ids":' + ids)
    else:
        out = (b'{"id":"lean","object":"text_completion","choices":['
               + choice[:-1] + b',"prompt_token_ids":' + ids + b"}")
    out += b',"kv_transfer_params":' + params + b"}"
    return web.Response(body=out, content_type="application/json")


def _frame(chat: bool, last: bool) -> bytes:
    finish = b'"length"' if last else b"null"
    if chat:
        return (b'data: {"id":"lean","object":"chat.completion.chunk","choices":[{"index":0,'
                b'"delta":{"content":"x"},"finish_reason":' + finish + b"}]}\n\n")
    return (b'data: {"id":"lean","object":"text_completion","choices":[{"index":0,'
            b'"text":"x","finish_reason":' + finish + b"}]}\n\n")


async def _decode(request: web.Request, body: _Body, chat: bool) -> web.StreamResponse:
    if not body.stream:
        text = b'"' + b"x" * body.max_tokens + b'"'
        msg = (b'{"role":"assistant","content":' + text + b"}") if chat else None
        out = (b'{"id":"lean","choices":[{"index":0,' + (b'"message":' + msg if chat
               else b'"text":' + text) + b',"finish_reason":"length"}]}')
        return web.Response(body=out, content_type="application/json")
    resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    for i in range(body.max_tokens):
        if i and body.x_frame_interval_s:
            await asyncio.sleep(body.x_frame_interval_s)
        await resp.write(_frame(chat, i == body.max_tokens - 1))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lean_engine")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", _health)
    app.router.add_post("/v1/chat/completions", _completion)
    app.router.add_post("/v1/completions", _completion)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()


