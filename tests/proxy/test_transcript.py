"""The transcript of a stream, on recorded vLLM-shaped events: ids recorded and taken out, events
passed whole however the bytes are cut, and a continuation's events made the stream's own."""

from __future__ import annotations

import json

from hypothesis import given
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
