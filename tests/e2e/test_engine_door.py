"""The engines of a dev deployment are not open doors: they listen on loopback only, and every
path but /health and /metrics needs the deployment's key (``launch/engine_guard.py``)."""

from __future__ import annotations

import httpx
import pytest

from harness.sockets import tcp_listeners, unix_listeners
from launch.engines import private_socket_dir

LOOPBACK = {"127.0.0.1", "::1"}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_direct_call_without_the_key_gets_401(tiny_stack, role):
    url = tiny_stack.prefill_url if role == "prefill" else tiny_stack.decode_url
    plain = {"model": tiny_stack.model_name, "prompt": "hello", "max_tokens": 1}
    body = dict(plain, kv_transfer_params={"do_remote_decode": True})
    with httpx.Client(base_url=url, timeout=60) as c:
        # vLLM's own key check covers /v1 only: /invocations would serve the completion and
        # /tokenize the ids without this deployment's guard.
        for path in ("/v1/completions", "/invocations", "/tokenize", "/kv_event_sources"):
            for headers in ({}, {"Authorization": "Bearer not-the-key"}):
                r = c.post(path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
        assert c.get("/health").status_code == 200
        assert "vllm:" in c.get("/metrics").text  # what the proxy routes on
        r = c.post("/v1/completions", json=plain, headers=tiny_stack.engine_headers)
        assert r.status_code == 200, r.text
    # ... and the proxy, which holds the key, still serves.
    r = httpx.post(tiny_stack.proxy_url + "/v1/completions", timeout=60,
                   json={"model": tiny_stack.model_name, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_every_listening_socket_of_dev_mode_is_on_loopback(tiny_stack):
    """pdserve dev (the proxy) and every process under it: the engines' HTTP servers, NIXL
    side channels, UCX listeners, engine cores."""
    pids = [tiny_stack.popen.pid]
    tcp = tcp_listeners(pids)
    ports = {int(listener.address.rsplit(":", 1)[1]) for listener in tcp}
    # The proxy, both engines and both side channels are among them (the listing works).
    assert {18000, 18100, 18101, 15600, 15601} <= ports, tcp
    wide = [listener for listener in tcp if listener.host not in LOOPBACK]
    assert not wide, f"listening beyond loopback: {wide}"
    # A publisher's listening socket and the connections it accepted share its path.
    kv = {u.address for u in unix_listeners(pids) if "kv-events" in u.address}
    assert sorted(kv) == [f"{private_socket_dir()}/kv-events-{port}" for port in (15700, 15701)]
