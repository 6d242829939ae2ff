"""The transcript of a stream, on recorded vLLM-shaped events: ids recorded and taken out, events
passed whole however the bytes are cut, and a continuation's events made the stream's own."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.transcript import Transcript


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def completion(i: int, text: str, finish=None, prompt=None, rid="cmpl-a", created=1) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
              "token_ids": [100 + i]}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    return event({"id": rid, "object": "text_completion", "created": created, "model": "m",
                  "choices": [choice]})


STREAM = completion(0, "a", prompt=[1, 2, 3]) + completion(1, "b") + completion(
    2, "c", finish="length") + b"data: [DONE]\n\n"


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), unique=True, max_size=12))
def test_events_are_passed_whole_however_the_bytes_are_cut(cuts):
    whole = Transcript(chat=False, keep_ids=False)
    want = whole.feed(STREAM)
    pieces = [STREAM[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(STREAM)])]
    cut = Transcript(chat=False, keep_ids=False)
    assert b"".join(cut.feed(p) for p in pieces) == want
    assert cut.prompt_ids == [1, 2, 3] and cut.output_ids == [100, 101, 102] and cut.finished
    assert b"token_ids" not in want and want.count(b"data: ") == 4


def test_an_event_the_lost_engine_did_not_finish_is_not_sent_nor_counted():
    t = Transcript(chat=False, keep_ids=False)
    first = completion(0, "a", prompt=[1, 2])
    second = completion(1, "b")
    out = t.feed(first + second[:20])
    assert out.count(b"data: ") == 1 and t.output_ids == [100]
    t.continued(as_completion=False)
    # The continuation (another engine, its own id and time) starts with token 1 again.
    out = t.feed(completion(1, "b", prompt=[1, 2, 100], rid="cmpl-other", created=9))
    (obj,) = [json.loads(e[6:]) for e in out.split(b"\n\n") if e]
    assert (obj["id"], obj["created"]) == ("cmpl-a", 1)
    assert "prompt_token_ids" not in obj["choices"][0] and t.output_ids == [100, 101]


def test_a_chat_stream_continued_as_a_completion_reads_as_chat():
    t = Transcript(chat=True, keep_ids=False)
    t.feed(event({"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 5,
                  "model": "m", "prompt_token_ids": [7, 8],
                  "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}]}))
    t.feed(event({"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 5,
                  "model": "m", "choices": [{"index": 0, "delta": {"content": "Hi"},
                                             "logprobs": None, "finish_reason": None,
                                             "token_ids": [100]}]}))
    assert t.prompt_ids == [7, 8] and t.output_ids == [100]
    t.continued(as_completion=True)
    out = t.feed(completion(1, " there", finish="stop", prompt=[7, 8, 100], rid="cmpl-y")
                 + event({"id": "cmpl-y", "object": "text_completion", "created": 6,
                          "model": "m", "choices": [],
                          "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                    "total_tokens": 4}}))
    objs = [json.loads(e[6:]) for e in out.split(b"\n\n") if e]
    assert [o["object"] for o in objs] == ["chat.completion.chunk"] * 2
    assert {o["id"] for o in objs} == {"chatcmpl-x"}
    assert objs[0]["choices"][0]["delta"] == {"content": " there"}
    assert objs[0]["choices"][0]["finish_reason"] == "stop"
    assert objs[1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_an_event_that_only_carried_ids_is_dropped_when_the_client_did_not_ask():
    t = Transcript(chat=True, keep_ids=False)
    only_ids = event({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                      "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                   "finish_reason": None, "token_ids": [100]}]})
    assert t.feed(only_ids) == b"" and t.output_ids == [100]
    assert Transcript(chat=True, keep_ids=True).feed(only_ids) == only_ids


# The quick path (one token of one choice, cut at the byte level) against the whole parse.
_TEXTS = st.sampled_from(["", "x", " world", 'say "token_ids":[1]}]}', "é\\n", "]}]}"])


@st.composite
def stream_events(draw):
    chat = draw(st.booleans())
    rid, created = "chatcmpl-a" if chat else "cmpl-a", 7
    first = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
             "created": created, "model": "m",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}]}
    if chat:
        first["prompt_token_ids"] = [1, 2]
    else:
        first["choices"] = [{"index": 0, "text": "", "logprobs": None, "finish_reason": None,
                             "prompt_token_ids": [1, 2], "token_ids": []}]
    events = [first]
    for i in range(draw(st.integers(1, 6))):
        choices = []
        # Mostly the common shape (one token of one choice), so the quick path is exercised.
        for c in range(draw(st.sampled_from([1, 1, 1, 2]))):
            text = draw(_TEXTS)
            choice: dict = {"index": c}
            if chat:
                choice["delta"] = draw(st.sampled_from([{"content": text}] * 3 + [
                    {}, {"content": None}, {"reasoning_content": text}]))
            else:
                choice["text"] = text
            choice["logprobs"] = None
            choice["finish_reason"] = draw(st.sampled_from([None] * 4 + ["stop", "length"]))
            if draw(st.booleans()):
                choice["stop_reason"] = None
            choice["token_ids"] = draw(st.lists(st.integers(0, 99999), max_size=3))
            choices.append(choice)
        obj = {"id": draw(st.sampled_from([rid] * 5 + ["other"])), "object": first["object"],
               "created": draw(st.sampled_from([created] * 5 + [8])), "model": "m",
               "choices": choices}
        if draw(st.integers(0, 7)) == 0:
            obj["usage"] = {"prompt_tokens": 2, "completion_tokens": i, "total_tokens": 2 + i}
        events.append(obj)
    return chat, b"".join(event(e) for e in events)


@settings(max_examples=300)
@given(stream_events(), st.booleans())
def test_the_quick_path_sends_and_records_what_the_whole_parse_does(case, keep_ids):
    chat, stream = case
    quick = Transcript(chat=chat, keep_ids=keep_ids)
    whole = Transcript(chat=chat, keep_ids=keep_ids)
    whole._quick = lambda event: None  # type: ignore[method-assign]
    got, want = quick.feed(stream), whole.feed(stream)
    assert [json.loads(e[6:]) for e in got.split(b"\n\n") if e] == [
        json.loads(e[6:]) for e in want.split(b"\n\n") if e]
    assert (quick.prompt_ids, quick.output_ids, quick.finished) == (
        whole.prompt_ids, whole.output_ids, whole.finished)
    assert quick.prompt_ids == [1, 2]
    assert (b"prompt_token_ids" in got) == keep_ids


def test_a_long_prompts_ids_are_cut_out_raw_and_parsed_only_when_asked_for():
    """The first event of a stream carries the whole prompt's ids (8,000 here): they are cut
    out as bytes on the way to the first token, and decoded only for a continuation."""
    ids = list(range(8000))
    for chat in (True, False):
        t = Transcript(chat=chat, keep_ids=False)
        if chat:
            first = event({"id": "c", "object": "chat.completion.chunk", "created": 1,
                           "model": "m", "choices": [{"index": 0, "delta": {"content": ""},
                                                      "finish_reason": None}],
                           "prompt_token_ids": ids})
        else:
            first = completion(0, "a", prompt=ids)
        out = t.feed(first)
        assert b"prompt_token_ids" not in out and len(out) < 300
        assert t._prompt is None  # not parsed yet
        assert t.prompt_ids == ids


def test_one_token_events_take_the_quick_path():
    """(The test above cannot fail if the quick path is never taken.)"""
    t = Transcript(chat=False, keep_ids=False)
    taken = []
    quick = t._quick

    def spy(event):
        out = quick(event)
        taken.append(out is not None)
        return out

    t._quick = spy  # type: ignore[method-assign]
    t.feed(STREAM)
    assert taken == [True, True, False]  # the middle and the finishing event ([DONE])
    assert t.finished and t.output_ids == [100, 101, 102]


def test_prompt_ids_that_are_not_ids_are_no_prompt_at_all():
    """Bytes that pass the cut's byte check but are not a JSON array of ids (``[1,,2]``): no
    prompt is known, so a continuation is refused, not crashed."""
    t = Transcript(chat=False, keep_ids=False)
    bad = completion(0, "a", prompt=[1, 2]).replace(b"[1,2]", b"[1,,2]")
    t.feed(bad)
    assert t.prompt_ids is None
