"""Talking to real engines and the proxy in tests and benchmarks: request bodies, a stream read
to its end, and the engine counters checks are made from."""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from transport.engine_metrics import engine_load

MAX_TOKENS = 16


def chat_body(model: str, text: str, stream: bool = False) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }


def prompt_sources(decode_url: str) -> dict[str, float]:
    text = httpx.get(decode_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:prompt_tokens_by_source":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["source"]] = s.value
    return out


def success_count(url: str) -> float:
    """Requests an engine finished, by its own metrics."""
    return engine_load(httpx.get(url + "/metrics", timeout=10).text).requests_finished


def stream_text(client: httpx.Client, url: str, body: dict) -> tuple[str, httpx.Headers, list[str]]:
    parts, frames = [], []
    with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            frames.append(line)
            if line == "data: [DONE]":
                break
            chunk = json.loads(line.removeprefix("data: "))
            for choice in chunk["choices"]:
                parts.append(choice.get("delta", {}).get("content") or "")
        headers = r.headers
    return "".join(parts), headers, frames


def proxy_metric(proxy_url: str, name: str, **labels: str) -> float:
    """One sample of the proxy's ``/metrics`` (0 when the series was never touched)."""
    text = httpx.get(proxy_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0
