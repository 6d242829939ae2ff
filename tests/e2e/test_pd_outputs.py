"""P/D through the proxy gives the decode engine's own greedy output; the KV really moved."""

from __future__ import annotations

import httpx
import pytest

from harness.engine_io import MAX_TOKENS, chat_body, prompt_sources, stream_text
from harness.prompts import text_of_tokens

LENGTHS = [100, 400, 1000, 1600, 3000]
@pytest.mark.parametrize("n_tokens", LENGTHS)
def test_proxy_matches_decode_engine_and_kv_moves(tiny_stack, n_tokens, golden_outputs):
    text = text_of_tokens(n_tokens, seed=n_tokens)
    body = chat_body(tiny_stack.model_name, text)
    with httpx.Client(timeout=300, headers=tiny_stack.engine_headers) as client:
        before = prompt_sources(tiny_stack.decode_url)
        r = client.post(tiny_stack.proxy_url + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        after = prompt_sources(tiny_stack.decode_url)
        assert r.headers["x-pd-route"] == "disaggregated"
        pd = r.json()
        prompt_tokens = pd["usage"]["prompt_tokens"]
        assert abs(prompt_tokens - n_tokens) < 40  # chat template adds a few tokens
        # Decode's own metrics: the prompt's KV arrived over NIXL, decode computed (almost) none.
        pulled = after["external_kv_transfer"] - before["external_kv_transfer"]
        computed = after["local_compute"] - before["local_compute"]
        assert pulled >= prompt_tokens - 16, (pulled, prompt_tokens)
        assert computed <= 16, computed
        # Same request on the decode engine alone (local compute) gives the same greedy text.
        direct = client.post(tiny_stack.decode_url + "/v1/chat/completions", json=body)
        assert direct.status_code == 200
        local = direct.json()
        assert pd["choices"][0]["message"]["content"] == local["choices"][0]["message"]["content"]
        assert pd["usage"] == local["usage"]  # the prompt is counted once
        golden_outputs[("chat", n_tokens)] = pd["choices"][0]["message"]["content"]
        assert pd["usage"]["completion_tokens"] == MAX_TOKENS
        assert len(pd["choices"][0]["message"]["content"]) > 0

        # Streaming: same text, vLLM's SSE framing ending in [DONE].
        s_text, s_headers, frames = stream_text(
            client, tiny_stack.proxy_url + "/v1/chat/completions",
            chat_body(tiny_stack.model_name, text, stream=True),
        )
        assert s_headers["x-pd-route"] == "disaggregated"
        assert frames[-1] == "data: [DONE]"
        assert all(f.startswith("data: ") for f in frames)
        assert s_text == local["choices"][0]["message"]["content"]


def test_request_id_travels(tiny_stack):
    body = chat_body(tiny_stack.model_name, text_of_tokens(50, seed=7))
    r = httpx.post(tiny_stack.proxy_url + "/v1/chat/completions", json=body,
                   headers={"x-request-id": "pd-test-id-123"}, timeout=120)
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "pd-test-id-123"
    assert "pd-test-id-123" in r.json()["id"]  # decode used the id the client gave


def test_decode_engine_uses_forwarded_prompt_token_ids(tiny_stack):
    """Decode skips templating/tokenizing when given ids: messages say A, ids say B -> B's answer."""
    from transformers import AutoTokenizer

    from launch.models import ensure_model

    tok = AutoTokenizer.from_pretrained(str(ensure_model("tiny")))
    a, b = text_of_tokens(60, seed=1), text_of_tokens(90, seed=2)
    model = tiny_stack.model_name
    with httpx.Client(timeout=120, headers=tiny_stack.engine_headers) as client:
        url = tiny_stack.decode_url + "/v1/chat/completions"
        ref_b = client.post(url, json=chat_body(model, b)).json()
        templated = tok.apply_chat_template(
            [{"role": "user", "content": b}], add_generation_prompt=True, tokenize=False
        )
        ids_b = tok.encode(templated, add_special_tokens=False)
        forged = chat_body(model, a)
        forged["kv_transfer_params"] = {"prompt_token_ids": list(ids_b)}
        got = client.post(url, json=forged).json()
    assert got["usage"]["prompt_tokens"] == len(ids_b) == ref_b["usage"]["prompt_tokens"]
    assert got["choices"][0]["message"]["content"] == ref_b["choices"][0]["message"]["content"]


def test_completions_endpoint_disaggregated(tiny_stack):
    body = {"model": tiny_stack.model_name, "prompt": text_of_tokens(300, seed=3),
            "max_tokens": 8, "temperature": 0}
    with httpx.Client(timeout=120, headers=tiny_stack.engine_headers) as client:
        r = client.post(tiny_stack.proxy_url + "/v1/completions", json=body)
        direct = client.post(tiny_stack.decode_url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-pd-route"] == "disaggregated"
    assert r.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    # The proxy also reads NIXL's own view of the pulls from the decode engine's metrics.
    from harness.routes import costs, wait_for

    wait_for(lambda: (costs(tiny_stack)["engines"]["decode-0"]["nixl_bytes_per_s"] or 0) > 1e6,
             "the decode engine's NIXL pull rate at the proxy", timeout_s=10)


def test_client_kv_transfer_params_never_reach_an_engine(tiny_stack):
    body = chat_body(tiny_stack.model_name, "hi")
    body["kv_transfer_params"] = {"do_remote_prefill": True, "remote_host": "10.0.0.1",
                                  "remote_port": 1}
    before = prompt_sources(tiny_stack.decode_url)
    r = httpx.post(tiny_stack.proxy_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "kv_transfer_params" and err["type"] == "invalid_request_error"
    assert prompt_sources(tiny_stack.decode_url) == before
