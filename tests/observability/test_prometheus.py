"""The observability files against a real Prometheus scraping a real stack: after some traffic
(P/D, local, streams beside arrivals), every PromQL expression of the dashboard and of the
recording rules parses and returns data. A panel naming a series nobody exports fails here."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import yaml

from harness.engine_io import chat_body
from harness.prompts import text_of_tokens
from launch.observability import dashboard
from launch.observability.prometheus import DASHBOARD, RULES
from tests.observability.conftest import PROMETHEUS_PORT

PROM = f"http://127.0.0.1:{PROMETHEUS_PORT}"
WINDOW = "2m"  # for Grafana's $__rate_interval


def query(expr: str) -> dict:
    r = httpx.get(PROM + "/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]


def route(stack, policy: str) -> None:
    r = httpx.post(stack.proxy_url + "/pd/admin/routing", json={"policy": policy}, timeout=30)
    assert r.status_code == 200, r.text


def traffic(stack) -> None:
    """Disaggregated and local requests, streams with arrivals beside them, a bad request."""
    model = stack.model_name
    with httpx.Client(timeout=120) as c:
        for policy in ("disaggregate", "local"):
            route(stack, policy)
            for seed in range(3):
                r = c.post(stack.proxy_url + "/v1/chat/completions",
                           json=chat_body(model, text_of_tokens(300, seed=900 + seed)))
                assert r.status_code == 200, r.text
        route(stack, "auto")
        assert c.post(stack.proxy_url + "/v1/chat/completions", json={"model": model}
                      ).status_code == 400
    # Streams that overlap: each arrival lands beside running streams (the ITL prediction).
    def stream(i: int) -> None:
        body = dict(chat_body(model, text_of_tokens(200 + 50 * i, seed=950 + i), stream=True),
                    max_tokens=200, ignore_eos=True)
        with httpx.Client(timeout=120) as c, c.stream(
                "POST", stack.proxy_url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert any(line == "data: [DONE]" for line in r.iter_lines())

    with ThreadPoolExecutor(6) as pool:
        futures = []
        for i in range(6):
            futures.append(pool.submit(stream, i))
            time.sleep(0.2)
        for f in futures:
            f.result()
    # The proxy compares an arrival's predicted gap with the worst one measured once the
    # streams beside it had 5 s to show it (proxy/step_tracker.py), on a later stream's frames.
    time.sleep(6)
    stream(6)


def wait_scraped(stack, timeout_s: float = 60.0) -> None:
    """Until Prometheus has scraped the proxy's and both engines' latest counters."""
    want = httpx.get(stack.proxy_url + "/metrics", timeout=10).text.count("pd_requests_total{")
    deadline = time.monotonic() + timeout_s
    while True:
        up = query('up{job="pdserve"}')["result"]
        seen = query("count(pd_requests_total)")["result"]
        if (len(up) == 3 and all(s["value"][1] == "1" for s in up) and seen
                and int(float(seen[0]["value"][1])) >= want):
            return
        assert time.monotonic() < deadline, f"targets {up}, series {seen} (want {want})"
        time.sleep(1)


def test_every_dashboard_and_rule_expression_returns_data(obs_stack):
    traffic(obs_stack)
    time.sleep(3)  # the last requests' deferred measurements, then two scrapes
    wait_scraped(obs_stack)
    empty = []
    exprs = [e.replace("$__rate_interval", WINDOW) for e in dashboard.expressions()]
    for expr in exprs:
        if not query(expr)["result"]:
            empty.append(expr)
    assert not empty, "no data for:\n" + "\n".join(empty)


def test_the_recording_rules_load_and_record(obs_stack):
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    deadline = time.monotonic() + 60
    while True:  # loaded and evaluated at least once, each healthy
        groups = httpx.get(PROM + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        if len(loaded) == len(rules) and all(r.get("lastEvaluation", "").startswith("20")
                                             for r in loaded.values()):
            break
        assert time.monotonic() < deadline, loaded
        time.sleep(1)
    bad = {n: r.get("lastError") for n, r in loaded.items() if r["health"] != "ok"}
    assert not bad, bad
    empty = [r["record"] for r in rules
             if not query(r["expr"].replace("[1m]", f"[{WINDOW}]"))["result"]]
    assert not empty, f"no data for the rules: {empty}"


def test_the_targets_file_lists_the_proxy_and_both_engines(obs_stack):
    path = obs_stack.log_dir / "observability" / "targets.json"
    groups = json.loads(path.read_text())
    assert sorted(g["labels"].get("pd_engine", "proxy") for g in groups) == [
        "decode-0", "prefill-0", "proxy"]


def test_the_committed_dashboard_is_the_generated_one():
    assert DASHBOARD.read_text() == dashboard.render(), (
        "run: python -m launch.observability.dashboard")
