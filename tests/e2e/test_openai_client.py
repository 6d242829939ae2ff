"""The official openai client works against the proxy: chat, streaming, completions, models."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(tiny_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_stack.proxy_url + "/v1", api_key="unused", timeout=120)


def test_models(client, tiny_stack):
    ids = [m.id for m in client.models.list()]
    assert ids == [tiny_stack.model_name]


def test_chat(client, tiny_stack):
    raw = client.chat.completions.with_raw_response.create(
        model=tiny_stack.model_name, messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=8, temperature=0,
    )
    assert raw.headers["x-pd-route"] == "disaggregated"
    resp = raw.parse()
    assert resp.choices[0].message.content
    assert resp.usage.completion_tokens == 8


def test_chat_stream(client, tiny_stack):
    chunks = list(client.chat.completions.create(
        model=tiny_stack.model_name, messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ref = client.chat.completions.create(
        model=tiny_stack.model_name, messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=8, temperature=0,
    )
    assert text == ref.choices[0].message.content
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 8


def test_completions(client, tiny_stack):
    resp = client.completions.create(
        model=tiny_stack.model_name, prompt="once upon a time", max_tokens=6, temperature=0
    )
    assert resp.choices[0].text
    assert resp.usage.completion_tokens == 6


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


def test_the_decision_log_shows_what_became_of_a_request(client, tiny_stack):
    """A streamed completion with its own ``x-request-id`` (as ``vllm bench serve`` sends):
    ``GET /pd/decisions`` shows its route, the prompt as the engine counted it, and a TTFT."""
    rid = "decision-log-e2e-1"
    chunks = list(client.completions.create(
        model=tiny_stack.model_name, prompt="once upon a time", max_tokens=4, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_headers={"x-request-id": rid}))
    usage = [c.usage for c in chunks if c.usage is not None][-1]
    r = httpx.get(tiny_stack.proxy_url + "/pd/decisions", params={"request_id": rid}, timeout=10)
    (entry,) = r.json()["decisions"]
    assert entry["route_taken"] in ("disaggregated", "local") and entry["reason"]
    assert entry["prompt_tokens"] == usage.prompt_tokens
    assert 0 < entry["ttft_ms"] < 120_000
