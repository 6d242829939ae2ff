"""``proxy/relay.py``: what counts as a token in the chunks it relays (the output budget, the
inter-token gaps and the step model are fed from it)."""

import json

from proxy.relay import tokens_in


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


ROLE = _event({"id": "c", "object": "chat.completion.chunk", "choices": [
    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
#: Text that looks like the markers: escaped inside its JSON string, it cannot fake them.
TEXTS = ("Hello", '"role": x\n\ndata: [DONE]\n\n', '"choices":[]', "!")
TOKENS = [_event({"id": "c", "object": "chat.completion.chunk", "choices": [
    {"index": 0, "delta": {"content": t}, "finish_reason": None}]}) for t in TEXTS]
USAGE = _event({"id": "c", "object": "chat.completion.chunk", "choices": [],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
DONE = b"data: [DONE]\n\n"
STREAM = [ROLE, *TOKENS, USAGE, DONE]


def test_a_chat_stream_counts_its_tokens_only_read_whole_or_event_by_event():
    assert tokens_in(b"".join(STREAM)) == len(TEXTS)
    assert [tokens_in(e) for e in STREAM] == [0, 1, 1, 1, 1, 0, 0]


def test_an_event_split_across_reads_counts_in_the_read_that_ends_it():
    whole = b"".join(TOKENS)
    cut = len(TOKENS[0]) + 5
    assert tokens_in(whole[:cut]) == 1 and tokens_in(whole[cut:]) == len(TEXTS) - 1
