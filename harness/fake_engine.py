"""An in-process fake of vLLM's OpenAI server, for the proxy's fault-injection tests.

It speaks the same HTTP protocol the proxy's ``EngineClient`` talks to a real engine: ``GET
/health``, ``POST /v1/chat/completions`` and ``POST /v1/completions``, on a real loopback socket
(aiohttp's ``TestServer`` on an ephemeral port). Like vLLM, one server plays either role per
request: a body whose ``kv_transfer_params`` has ``do_remote_decode`` is a prefill (reply with a
NIXL handoff and the prompt's token ids); anything else is a decode (a JSON reply, or an SSE stream
framed exactly as vLLM frames it: ``data: {...}\\n\\n`` ... ``data: [DONE]\\n\\n``).

Faults are knobs set per test before the request; hangs are gated by ``asyncio.Event`` (set the
event to release the handler; a request keeps the gate that was set when it arrived, so swapping
the knob between requests gates them separately; :meth:`FakeEngine.stop` releases every gate). A
prompt containing ``TOO_LONG`` gets vLLM's 400 in either role. When the proxy goes away mid-answer
(its connection closed: aiohttp cancels the handler, or a write fails) the fake records an abort,
as vLLM would abort the request. This fake adds faults the real engines can't produce
on demand; it never replaces the end-to-end tests on real engines.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

#: A prompt containing this is over the (fake) context length: vLLM answers 400.
TOO_LONG = "TOO_LONG"
DONE_FRAME = b"data: [DONE]\n\n"
#: Content tokens each decode stream sends (one SSE frame each) before the finish frame.
STREAM_TOKENS = ("Hello", ",", " world", "!")
#: The fake's answer is a greedy model's: token j of ``stream_tokens`` has id OUTPUT_ID_BASE + j,
#: and a token-id prompt that ends in such ids is continued from the next token (what another
#: engine does with a migrated stream's prompt).
OUTPUT_ID_BASE = 50_000


@dataclass(frozen=True)
class Recorded:
    """One completion request as the engine received it."""

    path: str
    headers: dict[str, str]  # lower-case names
    body: dict[str, Any]

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")


@dataclass
class FakeEngine:
    name: str = "engine"

    # --- fault knobs (set before the request) ---
    #: Status of a prefill reply; anything but 200 comes with vLLM's error body.
    prefill_status: int = 200
    #: When set, a prefill replies 200 with these raw bytes instead of a handoff.
    prefill_raw_reply: bytes | None = None
    #: When set, a prefill waits for this event before answering (a hung prefill).
    prefill_gate: asyncio.Event | None = None
    #: When set, a decode waits for this event after ``decode_gate_after_frames`` frames
    #: (0: before sending anything, not even headers).
    decode_gate: asyncio.Event | None = None
    decode_gate_after_frames: int = 0
    #: When set, the engine core is hung behind a live API server (vLLM's /health still
    #: answers): every completion waits for this event, a streamed one after its headers (as
    #: vLLM's server sends them before the first output).
    core_hung: asyncio.Event | None = None
    #: When set, a streaming decode writes this many frames and then drops the connection.
    decode_drop_after_frames: int | None = None
    #: A whole (unstreamed) decode reply sends its headers and half its body, then drops.
    decode_drop_reply: bool = False
    #: Status of a decode reply; anything but 200 comes with vLLM's error body (500: what vLLM
    #: answers while its engine core is dead).
    decode_status: int = 200
    #: A decode request carrying a hand-off's prompt ids gets vLLM's 400 for ids out of its
    #: vocabulary (``param`` naming them: vLLM's online renderer), as one with the engines'
    #: models mismatched would.
    decode_refuses_handoff_ids: bool = False
    #: When set, a streaming decode writes this many frames, then ends the stream as vLLM does
    #: when its engine core dies: an error event with ``decode_error_code``, then ``[DONE]``.
    decode_error_after_frames: int | None = None
    decode_error_code: int = 500
    #: Content tokens of each decode stream (one SSE frame each), and the pause between frames.
    stream_tokens: tuple[str, ...] = STREAM_TOKENS
    decode_frame_interval_s: float = 0.0
    #: A streaming decode's wait between its headers and its first frame (its prefill).
    decode_first_frame_s: float = 0.0

    # --- what happened ---
    prefill_requests: list[Recorded] = field(default_factory=list)
    decode_requests: list[Recorded] = field(default_factory=list)
    #: The ``kv_transfer_params`` of each handoff this engine replied with.
    handoffs: list[dict[str, Any]] = field(default_factory=list)
    #: The prompt token ids of each handoff.
    handoff_prompt_ids: list[list[int]] = field(default_factory=list)
    #: Every byte each decode stream wrote, one entry per stream.
    sent_streams: list[bytes] = field(default_factory=list)
    health_checks: int = 0
    #: Set when a prefill (decode) handler lost its client before it finished: the connection
    #: was closed (handler cancelled) or a write failed. The counts say how many times.
    prefill_aborted: asyncio.Event = field(default_factory=asyncio.Event)
    decode_aborted: asyncio.Event = field(default_factory=asyncio.Event)
    prefill_aborts: int = 0
    decode_aborts: int = 0

    def __post_init__(self) -> None:
        self._server: TestServer | None = None
        self._url: str | None = None
        self._changed = asyncio.Condition()
        self._arrived = 0
        self._gates: set[asyncio.Event] = set()  # every gate a request waited on

    # --- lifecycle ---

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/completions", self._completion)
        self._server = TestServer(app, host="127.0.0.1")
        await self._server.start_server()
        self._url = f"http://127.0.0.1:{self._server.port}"

    async def stop(self) -> None:
        """Release every gate, then close the server (a stopped engine refuses connections)."""
        for gate in (self.prefill_gate, self.decode_gate, *self._gates):
            if gate is not None:
                gate.set()
        if self._server is not None:
            await self._server.close()
            self._server = None

    @property
    def url(self) -> str:
        """The base URL; still valid after :meth:`stop` (it then refuses connections)."""
        assert self._url is not None, "start() first"
        return self._url

    @property
    def completion_requests(self) -> list[Recorded]:
        return [*self.prefill_requests, *self.decode_requests]

    async def wait_for_health_checks(self, n: int, timeout_s: float = 30.0) -> None:
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: self.health_checks >= n)

    async def wait_for_requests(self, n: int, timeout_s: float = 30.0) -> None:
        """Wait until ``n`` completion requests have arrived (hung ones included); a test that
        waits in vain fails after ``timeout_s`` instead of hanging CI."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: self._arrived >= n)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # --- handlers ---

    async def _health(self, _request: web.Request) -> web.Response:
        self.health_checks += 1
        await self._notify()
        return web.Response()

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        recorded = Recorded(
            request.path, {k.lower(): v for k, v in request.headers.items()}, body
        )
        params = body.get("kv_transfer_params")
        is_prefill = isinstance(params, dict) and bool(params.get("do_remote_decode"))
        (self.prefill_requests if is_prefill else self.decode_requests).append(recorded)
        self._arrived += 1
        await self._notify()
        if TOO_LONG in _prompt_text(body):
            return _error(400, "BadRequestError", "This model's maximum context length is 64 "
                          "tokens. However, your request has 9000 input tokens. Please reduce "
                          "the length of the input messages.")
        try:
            hung = self._take(self.core_hung)
            if hung is not None and not (body.get("stream") and not is_prefill):
                await hung.wait()
            if is_prefill:
                return await self._prefill(recorded, self._take(self.prefill_gate))
            return await self._decode(request, recorded, self._take(self.decode_gate), hung)
        except (asyncio.CancelledError, ConnectionError):
            self._record_abort(is_prefill)
            raise

    def _take(self, gate: asyncio.Event | None) -> asyncio.Event | None:
        """The gate this request waits on: the knob's value when it arrived."""
        if gate is not None:
            self._gates.add(gate)
        return gate

    def _record_abort(self, is_prefill: bool) -> None:
        if is_prefill:
            self.prefill_aborts += 1
            self.prefill_aborted.set()
        else:
            self.decode_aborts += 1
            self.decode_aborted.set()

    async def _prefill(self, rec: Recorded, gate: asyncio.Event | None) -> web.Response:
        if gate is not None:
            await gate.wait()
        if self.prefill_status != 200:
            return _error(self.prefill_status, "InternalServerError", "EngineCore died")
        if self.prefill_raw_reply is not None:
            return web.Response(body=self.prefill_raw_reply, content_type="application/json")
        ids = _prompt_ids(rec.body)
        n = len(self.handoffs)
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[10 + n, 11 + n, 12 + n]],
            "remote_engine_id": f"fake-{self.name}-engine",
            "remote_request_id": f"{_kind(rec.path)}-{rec.request_id}-0-{n:04x}",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(ids),
            "remote_blocks_expiry_time": 1234.5,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0,
            "x_fake_engine_extra": {"kept": True},  # an unknown key: must reach decode verbatim
        }
        self.handoffs.append(params)
        self.handoff_prompt_ids.append(ids)
        reply = _reply(rec, "X") | {"kv_transfer_params": params}
        if rec.path.endswith("/chat/completions"):
            reply["prompt_token_ids"] = ids
        else:
            reply["choices"][0]["prompt_token_ids"] = ids
        return web.json_response(reply)

    async def _decode(
        self, request: web.Request, rec: Recorded, gate: asyncio.Event | None,
        hung: asyncio.Event | None = None
    ) -> web.StreamResponse:
        if gate is not None and self.decode_gate_after_frames == 0:
            await gate.wait()
        sent = rec.body.get("kv_transfer_params")
        if self.decode_refuses_handoff_ids and isinstance(sent, dict) and \
                sent.get("prompt_token_ids") is not None:
            return _error(400, "BadRequestError", "Token id 999999 is out of vocabulary",
                          param="kv_transfer_params.prompt_token_ids")
        if self.decode_status != 200:
            return _error(self.decode_status, "InternalServerError", "EngineCore encountered an "
                          "issue. See stack trace (above) for the root cause.")
        if not rec.body.get("stream"):
            reply = _reply(rec, "".join(self.stream_tokens)) | {
                "kv_transfer_params": None,
                "x_fake_received_kv_transfer_params": "kv_transfer_params" in rec.body,
            }
            if self.decode_drop_reply:
                data = json.dumps(reply).encode()
                resp = web.StreamResponse(status=200, headers={
                    "content-type": "application/json", "content-length": str(len(data))})
                await resp.prepare(request)
                await resp.write(data[: len(data) // 2])
                assert request.transport is not None
                request.transport.close()  # a crashed engine, mid-reply
                return resp
            return web.json_response(reply)
        resp = web.StreamResponse(
            status=200, headers={"content-type": "text/event-stream; charset=utf-8"}
        )
        await resp.prepare(request)
        if hung is not None:
            await hung.wait()
        if self.decode_first_frame_s:
            await asyncio.sleep(self.decode_first_frame_s)
        sent = bytearray()
        slot = len(self.sent_streams)  # streams may interleave: each updates its own entry
        self.sent_streams.append(b"")
        for i, frame in enumerate(_frames(rec, self.stream_tokens)):
            if i == self.decode_drop_after_frames:
                assert request.transport is not None
                request.transport.close()  # a crashed engine: no terminating chunk
                return resp
            if i == self.decode_error_after_frames:
                # vLLM 0.32's completion stream generator on EngineDeadError, byte for byte.
                error = {"error": {"message": "EngineCore encountered an issue. See stack "
                                   "trace (above) for the root cause.",
                                   "type": "InternalServerError"
                                   if self.decode_error_code >= 500 else "BadRequestError",
                                   "param": None, "code": self.decode_error_code}}
                await resp.write(b"data: " + json.dumps(error).encode() + b"\n\n")
                await resp.write(DONE_FRAME)
                await resp.write_eof()
                return resp
            if gate is not None and i == self.decode_gate_after_frames > 0:
                await gate.wait()
            if i and self.decode_frame_interval_s:
                await asyncio.sleep(self.decode_frame_interval_s)  # the time a token takes
            await resp.write(frame)
            sent += frame
            self.sent_streams[slot] = bytes(sent)
        await resp.write_eof()
        return resp


def _kind(path: str) -> str:
    return "chatcmpl" if path.endswith("/chat/completions") else "cmpl"


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return " ".join(str(m.get("content") or "") for m in body["messages"])
    return str(body.get("prompt"))


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    """Deterministic fake token ids: one per four prompt characters, at least one (a prompt
    of token ids: those)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return list(prompt)
    return list(range(1000, 1000 + max(1, len(_prompt_text(body)) // 4)))


def _reply(rec: Recorded, text: str) -> dict[str, Any]:
    """A whole (non-stream) vLLM reply for ``rec``'s endpoint."""
    kind = _kind(rec.path)
    if kind == "chatcmpl":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                  "stop_reason": None}
        obj = "text_completion"
    return {
        "id": f"{kind}-{rec.request_id}",
        "object": obj,
        "created": 1767225600,
        "model": rec.body.get("model", "m"),
        "choices": [choice],
        "usage": {"prompt_tokens": 8, "total_tokens": 9, "completion_tokens": 1},
    }


def _frames(rec: Recorded, tokens: tuple[str, ...] = STREAM_TOKENS) -> list[bytes]:
    """The SSE frames of one stream, as vLLM writes them (compact JSON, blank-line separated):
    the answer continued after any of its own ids the prompt ends with, cut at ``max_tokens``;
    with ``return_token_ids``, each token's id and (first event) the prompt's; with
    ``stream_options.include_usage``, a last usage event."""
    kind = _kind(rec.path)
    body = rec.body
    base = {"id": f"{kind}-{rec.request_id}", "created": 1767225600,
            "model": body.get("model", "m")}
    prompt = _prompt_ids(body)
    start = _continued_from(body)
    budget = body.get("max_completion_tokens", body.get("max_tokens"))
    end = len(tokens) if not isinstance(budget, int) else min(len(tokens), start + budget)
    ids = body.get("return_token_ids") is True
    chunks: list[dict[str, Any]] = []
    if kind == "chatcmpl":
        base["object"] = "chat.completion.chunk"
        first = base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]}
        if ids:
            first["prompt_token_ids"] = prompt
        chunks.append(first)
        for j in range(start, end):
            choice = {"index": 0, "delta": {"content": tokens[j]}, "logprobs": None,
                      "finish_reason": "length" if j == end - 1 else None}
            if ids:
                choice["token_ids"] = [OUTPUT_ID_BASE + j]
            chunks.append(base | {"choices": [choice]})
    else:
        base["object"] = "text_completion"
        for j in range(start, end):
            choice = {"index": 0, "text": tokens[j], "logprobs": None,
                      "finish_reason": "length" if j == end - 1 else None}
            if ids:
                choice["token_ids"] = [OUTPUT_ID_BASE + j]
                if j == start:
                    choice["prompt_token_ids"] = prompt
            chunks.append(base | {"choices": [choice]})
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append(base | {"choices": [], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": end - start,
            "total_tokens": len(prompt) + end - start}})
    frames = [b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks]
    return [*frames, DONE_FRAME]


def _continued_from(body: dict[str, Any]) -> int:
    """How many of the answer's own tokens a token-id prompt already ends with (ids
    OUTPUT_ID_BASE, OUTPUT_ID_BASE + 1, ... in order)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt or type(prompt[-1]) is not int:
        return 0
    k = prompt[-1] - OUTPUT_ID_BASE + 1
    if k <= 0 or k > len(prompt):
        return 0
    return k if prompt[-k:] == list(range(OUTPUT_ID_BASE, OUTPUT_ID_BASE + k)) else 0


def _error(status: int, type_: str, message: str, param: str | None = None) -> web.Response:
    """vLLM's error body."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return web.json_response(body, status=status)
