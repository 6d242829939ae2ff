"""What a client has been sent of one stream, event by event: enough to continue it elsewhere.

A stream whose decode engine is lost mid-answer can be continued by another engine given the
original prompt's token ids plus the ids already relayed (``proxy/migration.py``). To know them,
the decode request of such a stream asks vLLM for ``return_token_ids``; the :class:`Transcript`
reads each event the engine sends, records ``prompt_token_ids`` and each choice's
``token_ids``, and passes the client the event without them (unless the client asked for the
ids itself).

Events are passed on whole: bytes are held until their ``\\n\\n`` arrives, so an event cut by a
lost engine is never half-sent, and its tokens are not counted as delivered.

Most events of a stream are one token of one choice (the last one too, when it finishes on a
token): those take a quick path
(:func:`proxy.event_bytes.one_token`), sent as the engine's bytes with the ids cut out. Every
other event (the first, usage, a finish without a token, an id that differs, a continuation's)
is parsed and rewritten whole.

A continuation is another engine's answer to another prompt. Its events are rewritten to read
as the stream's own (:meth:`Transcript.continued`): the first event's ``id`` and ``created``;
``usage`` with the original prompt counted once (the continuation's prompt holds the delivered
tokens: they move back to ``completion_tokens``); and, for a chat stream continued as a
completion of token ids (vLLM's chat API takes no token-id prompt), each completion choice
turned into a chat delta.

An engine that fails while its API server lives on (its engine core killed, as an out-of-memory
kill or a device fault does) ends the stream itself, with an error event (``code`` 500) and
``[DONE]``: those are withheld (:attr:`Transcript.engine_error`) and the stream is continued as
for a lost connection. An error event with a 4xx code is the request's and passes through.
"""

from __future__ import annotations

from typing import Any

import msgspec

from proxy.event_bytes import DATA as _DATA
from proxy.event_bytes import cut_prompt_ids, one_token

_DONE = b"[DONE]"
#: Every event of a migratable stream is read (and most written back): msgspec's JSON, several
#: times faster than the standard library's (compact, UTF-8 as vLLM writes it).
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


class Transcript:
    def __init__(self, chat: bool, keep_ids: bool):
        #: The stream is a chat completion (events must read as ``chat.completion.chunk``).
        self.chat = chat
        #: The client asked for ``return_token_ids`` itself: leave the output ids in.
        self.keep_ids = keep_ids
        #: The first engine's prompt ids as it wrote them (a JSON array), decoded only if the
        #: stream is continued: a long prompt's ids are not parsed on the way to the first token.
        self._prompt_raw: bytes | None = None
        self._prompt: list[int] | None = None
        self.output_ids: list[int] = []
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        #: A choice carried a ``finish_reason``: nothing is left to continue.
        self.finished = False
        #: The engine reported its own failure in band (an error event with a 5xx code, as
        #: vLLM sends when its engine core dies mid-stream): that event and everything after
        #: it are withheld, for the stream to be continued elsewhere.
        self.engine_error: str | None = None
        #: Output ids in the prompt of the engine answering now (0 for the first engine).
        self._carried = 0
        #: The engine answering now writes completion events for a chat stream.
        self._as_chat = False
        self._held = b""
        self._changed = False
        #: The client has had the stream's usage event (choices empty) / its role event.
        self._usage_sent = self._role_sent = False
        #: The engine answering now starts with a role event the client has had already.
        self._skip_role = False

    @property
    def prompt_ids(self) -> list[int] | None:
        if self._prompt is None and self._prompt_raw is not None:
            try:
                self._prompt = msgspec.json.decode(self._prompt_raw, type=list[int])
            except (msgspec.DecodeError, msgspec.ValidationError):  # not ids: none known
                self._prompt_raw = None
        return self._prompt

    def continued(self, as_completion: bool) -> None:
        """Another engine takes over from here: its prompt carries the ids delivered so far;
        ``as_completion``: it answers a completion request for this chat stream."""
        self._carried = len(self.output_ids)
        self._as_chat = self.chat and as_completion
        self._skip_role = self._role_sent and not as_completion
        self._held = b""  # an event the lost engine did not finish was never sent
        self.engine_error = None

    def feed(self, chunk: bytes) -> bytes:
        """The client's bytes for ``chunk``: each event it completes, rewritten."""
        held = self._held + chunk
        end = held.rfind(b"\n\n")
        if end < 0:
            self._held = held
            return b""
        self._held = held[end + 2:]
        out = []
        for event in held[:end].split(b"\n\n"):
            rewritten = self._event(event)
            if rewritten is not None:
                out.append(rewritten)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes | None:
        stripped = event.strip()
        if not stripped or self.engine_error is not None:
            return None
        if not self._carried and not self.keep_ids:
            if self.id is not None:
                quick = self._quick(stripped)
                if quick is not None:
                    return quick
            elif self._prompt_raw is None and not self._as_chat:
                stripped, self._prompt_raw = cut_prompt_ids(stripped)
        if not stripped.startswith(_DATA) or stripped[len(_DATA):].strip() == _DONE:
            return stripped + b"\n\n"
        try:
            obj = _decode(stripped[len(_DATA):])
        except msgspec.DecodeError:
            return stripped + b"\n\n"
        if not isinstance(obj, dict):
            return stripped + b"\n\n"
        if "error" in obj:
            if _engine_failure(obj["error"]):
                self.engine_error = str(obj["error"].get("message") or "engine error")
                return None
            return stripped + b"\n\n"  # the request's own error (4xx): the client's to see
        self._changed = False
        obj = self._rewrite(obj)
        if obj is None:
            return None
        if not self._changed:  # nothing to take out or rewrite: the engine's own bytes
            return stripped + b"\n\n"
        return _DATA + _encode(obj) + b"\n\n"

    def _quick(self, event: bytes) -> bytes | None:
        """``event`` without its token ids, recorded, if it is one token of one choice that
        says something (:func:`proxy.event_bytes.one_token`); else None (parse it whole)."""
        cut = one_token(event, self.id, self.created)
        if cut is None:
            return None
        self.output_ids.extend(cut[1])
        self.finished = self.finished or cut[2]
        return cut[0]

    def _rewrite(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        first_engine = self._carried == 0 and not self._as_chat
        if self.id is None:
            self.id, self.created, self.model = obj.get("id"), obj.get("created"), obj.get("model")
        elif (obj.get("id"), obj.get("created")) != (self.id, self.created):
            obj["id"], obj["created"] = self.id, self.created
            self._changed = True
        self._take_prompt(obj, first_engine)  # chat: on the first event
        if _role_only(obj):
            if self._skip_role:  # the same request on another engine, its role said already
                self._skip_role = False
                return None
            self._role_sent = True
        self._usage_sent = self._usage_sent or bool(obj.get("usage") and not obj.get("choices"))
        empty = bool(obj.get("choices"))
        for choice in obj.get("choices") or []:
            self._take_prompt(choice, first_engine)  # completions: in the first choice
            ids = choice.get("token_ids") if self.keep_ids else choice.pop("token_ids", None)
            self._changed = self._changed or (ids is not None and not self.keep_ids)
            if ids:
                self.output_ids.extend(ids)
            if choice.get("finish_reason") is not None:
                self.finished = True
            empty = empty and ids is not None and not _has_content(choice) and (
                choice.get("finish_reason") is None)
        if empty and not self.keep_ids and not obj.get("usage"):
            return None  # an event sent only to carry token ids the client did not ask for
        usage = obj.get("usage")
        if usage and self._carried:
            usage["prompt_tokens"] = usage.get("prompt_tokens", 0) - self._carried
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + self._carried
            self._changed = True
        if self._as_chat:
            obj = self._as_chat_event(obj)
            self._changed = True
        return obj

    def _take_prompt(self, holder: dict[str, Any], first_engine: bool) -> None:
        """Record the prompt's ids from ``holder`` (the first engine's), and take them out
        unless the client asked for them (a continuation's prompt is never the client's)."""
        if "prompt_token_ids" not in holder:
            return
        prompt = holder["prompt_token_ids"]
        if prompt is not None and self.prompt_ids is None and first_engine:
            self._prompt = list(prompt)
            if self.keep_ids:
                return
        del holder["prompt_token_ids"]
        self._changed = True

    def _as_chat_event(self, obj: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for c in obj.get("choices") or []:
            text = c.get("text") or ""
            choice: dict[str, Any] = {"index": c.get("index", 0),
                                      "delta": {"content": text} if text else {},
                                      "logprobs": None, "finish_reason": c.get("finish_reason")}
            if c.get("stop_reason") is not None:
                choice["stop_reason"] = c["stop_reason"]
            if self.keep_ids and "token_ids" in c:
                choice["token_ids"] = c["token_ids"]
            choices.append(choice)
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk",
                               "created": self.created, "model": obj.get("model", self.model),
                               "choices": choices}
        for key in ("usage", "system_fingerprint"):
            if obj.get(key) is not None:
                out[key] = obj[key]
        return out

    def closing(self, usage: bool) -> bytes:
        """The events that end a stream whose every token was delivered but whose end was
        lost: the finish (``length``: the budget is spent) unless it came, usage when asked,
        and ``[DONE]``."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        events: list[dict[str, Any]] = []
        if not self.finished:
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if self.chat:
                choice.update(delta={}, logprobs=None)
            else:
                choice.update(text="", logprobs=None)
            events.append({"id": self.id, "object": kind, "created": self.created,
                           "model": self.model, "choices": [choice]})
        if usage and not self._usage_sent:  # (sent, only its [DONE] was lost)
            prompt = len(self.prompt_ids or [])
            done = len(self.output_ids)
            events.append({"id": self.id, "object": kind, "created": self.created,
                           "model": self.model, "choices": [],
                           "usage": {"prompt_tokens": prompt, "completion_tokens": done,
                                     "total_tokens": prompt + done}})
        self.finished = True
        return b"".join(_DATA + _encode(e) + b"\n\n" for e in events) + _DATA + _DONE + (
            b"\n\n")


def _role_only(event: dict[str, Any]) -> bool:
    """A chat stream's role event: each choice's delta names the role, and says nothing."""
    choices = event.get("choices")
    return isinstance(choices, list) and bool(choices) and all(
        isinstance(c, dict) and isinstance(c.get("delta"), dict) and "role" in c["delta"]
        and not c["delta"].get("content") and not c.get("finish_reason") for c in choices)


def _has_content(choice: dict[str, Any]) -> bool:
    """The choice says something beyond its token ids (text, a delta, log probabilities)."""
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    if isinstance(delta, dict) and any(v not in (None, "", []) for v in delta.values()):
        return True
    return choice.get("logprobs") is not None


def _engine_failure(error: Any) -> bool:
    """An in-band error event's ``error`` says the engine failed (a 5xx code: vLLM's
    ``EngineDeadError``, an internal generation error), not the request."""
    return isinstance(error, dict) and isinstance(error.get("code"), int) and (
        error["code"] >= 500)
