"""Every body the proxy sends an engine is one vLLM accepts whenever it accepts the client's
(vLLM's own request models and sampling checks; no engine started). A body refused there would
fail the request on one route and not the other (the prefill engine's 400 is the client's)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.engine_bodies import prefill_body, release_body
from proxy.requests import check_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}

CASES = [
    ("chat", CHAT | {"max_tokens": 16, "min_tokens": 4}),
    ("completions", COMPLETION | {"max_tokens": 16, "min_tokens": 4}),
    ("chat", CHAT | {"max_completion_tokens": 16, "min_tokens": 16}),
    ("chat", CHAT | {"stream": True, "stream_options": {"include_usage": True},
                     "max_tokens": 8}),
    ("chat", CHAT | {"logprobs": True, "top_logprobs": 2, "max_tokens": 8}),
    ("completions", COMPLETION | {"logprobs": 2, "echo": True, "max_tokens": 8}),
    ("chat", CHAT | {"stop": ["\n"], "ignore_eos": True, "seed": 7, "max_tokens": 8}),
]


def sampling(endpoint: str, body: dict[str, Any]) -> Any:
    if endpoint == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest as Request,
        )
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Request
    req = Request.model_validate(body)
    return req.to_sampling_params(max_tokens=req.max_tokens or 16, default_sampling_params={})


@pytest.mark.parametrize(("endpoint", "body"), CASES)
def test_the_bodies_sent_to_engines_are_valid_when_the_clients_is(endpoint, body):
    check_request(endpoint, dict(body), {"m"})
    sampling(endpoint, dict(body))  # the client's own request: vLLM takes it
    sampling(endpoint, prefill_body(body))
    sampling(endpoint, release_body(body))
