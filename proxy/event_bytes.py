"""Byte-level cuts of vLLM's stream events: the quick paths of :class:`proxy.transcript.Transcript`.

Most events of a stream are one token of one choice, which vLLM writes (fields in model order,
unset ones left out) as ``...,"finish_reason":null,"token_ids":[N]}]}``. :func:`one_token` reads
such an event into a typed view of just the fields that decide (C, nothing else built) and
returns the engine's bytes with the ids cut out. The first event carries the prompt's ids;
:func:`cut_prompt_ids` cuts them out raw, so that a long prompt's ids are not parsed on the way
to the first token. Whatever these cannot vouch for, they decline, and the caller parses the
event whole.
"""

from __future__ import annotations

from typing import Any

import msgspec

DATA = b"data: "
_IDS_KEY = b',"token_ids":['
_PROMPT_KEY = b',"prompt_token_ids":['
_ID_BYTES = b"0123456789, "
_TAIL = b"]}]}"
_encode = msgspec.json.Encoder().encode


class _ChoiceView(msgspec.Struct):
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    text: str | None = None
    delta: dict[str, Any] | None = None
    prompt_token_ids: Any = msgspec.UNSET


class _EventView(msgspec.Struct):
    """What decides whether an event can take the quick path (``UNSET``: the key is absent;
    a value of another type than these fails the view, and the event is parsed whole)."""
    id: str | None = None
    created: int | None = None
    choices: list[_ChoiceView] | None = None
    prompt_token_ids: Any = msgspec.UNSET
    error: Any = msgspec.UNSET


_view = msgspec.json.Decoder(_EventView).decode
_UNSET = msgspec.UNSET


def one_token(event: bytes, rid: str | None, created: int | None
              ) -> tuple[bytes, list[int], bool] | None:
    """``event`` (stripped, ``data: `` first) without its token ids, those ids, and whether it
    finishes the choice, if it is one token of one choice of the stream ``rid`` made at
    ``created`` that says something (text or a delta); else None."""
    if not event.endswith(_TAIL) or not event.startswith(DATA):
        return None
    at = event.rfind(_IDS_KEY)
    if at < 0:
        return None
    try:
        view = _view(event[len(DATA):])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    choices = view.choices
    if (choices is None or len(choices) != 1 or view.id != rid or view.created != created
            or view.prompt_token_ids is not _UNSET or view.error is not _UNSET):
        return None
    choice = choices[0]
    if (not choice.token_ids or choice.prompt_token_ids is not _UNSET
            or not (choice.text or (choice.delta and choice.delta.get("content")))):
        return None
    ids = choice.token_ids
    # What is cut must be exactly the choice's ids, the last key of the last choice.
    if event[at + len(_IDS_KEY) - 1:-len(_TAIL) + 1] != _encode(ids):
        return None
    return event[:at] + b"}]}\n\n", ids, choice.finish_reason is not None


def cut_prompt_ids(event: bytes) -> tuple[bytes, bytes | None]:
    """``event`` without the prompt's ids, and those ids raw (a JSON array), when they are
    where vLLM writes them (a key after others, an array of ids only) and once; else ``event``
    itself and None (the whole parse takes them out). A ``,"`` cannot occur inside a JSON
    string (its quote would be escaped), so the key found is a key."""
    at = event.find(_PROMPT_KEY)
    if at < 0:
        return event, None
    start = at + len(_PROMPT_KEY) - 1
    end = event.find(b"]", start)
    raw = event[start:end + 1]
    if end < 0 or raw.translate(None, _ID_BYTES) != b"[]" or event.count(
            b'"prompt_token_ids"') != 1:
        return event, None
    return event[:at] + event[end + 1:], raw
