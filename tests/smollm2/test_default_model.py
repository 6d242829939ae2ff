"""The default model (SmolLM2-135M-Instruct, converted locally) answers sensibly through dev mode:
the first thing a new user sees is a working chat."""

from __future__ import annotations

import openai


def test_capital_of_france(smollm2_stack):
    client = openai.OpenAI(base_url=smollm2_stack.proxy_url + "/v1", api_key="-", timeout=300)
    for route in ("any", "stream"):
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        if route == "stream":
            chunks = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24, temperature=0,
                stream=True)
            answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            resp = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24, temperature=0)
            answer = resp.choices[0].message.content
        assert "Paris" in answer, answer


def test_default_model_disaggregated_matches_local(smollm2_stack):
    """Forced P/D on the real model gives the decode engine's own greedy answer."""
    import httpx

    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three primary colors."}]}
    direct = httpx.post(smollm2_stack.decode_url + "/v1/chat/completions", json=body, timeout=300,
                        headers=smollm2_stack.engine_headers)
    from transport import kv_params

    pbody = dict(body, max_tokens=1, return_token_ids=True)
    pbody[kv_params.BODY_KEY] = kv_params.prefill_request_params()
    reply = httpx.post(smollm2_stack.prefill_url + "/v1/chat/completions", json=pbody,
                       timeout=300, headers=smollm2_stack.engine_headers).json()
    dbody = dict(body)
    dbody[kv_params.BODY_KEY] = kv_params.decode_request_params(
        kv_params.parse_prefill_reply(reply))
    pd = httpx.post(smollm2_stack.decode_url + "/v1/chat/completions", json=dbody, timeout=300,
                    headers=smollm2_stack.engine_headers)
    assert pd.status_code == 200, pd.text
    assert (pd.json()["choices"][0]["message"]["content"]
            == direct.json()["choices"][0]["message"]["content"])
