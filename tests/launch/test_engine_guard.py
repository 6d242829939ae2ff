"""The engines' door (``launch/engine_guard.py``) and how the launcher sets it up: the key by
environment only, the middleware on the command line, KV events on a private socket.

The real engines' 401s are checked in ``tests/e2e/test_engine_door.py``."""

from __future__ import annotations

import json
import os
import socket
import stat

import httpx
import pytest

from launch.engine_guard import KEY_ENV, OPEN_PATHS, EngineGuard
from launch.engines import EngineSpec, engine_argv, engine_env, private_socket_dir
from launch.processes import PortBusy, check_endpoints_free
from proxy.config import ProxyConfig

KEY = "s3cret-key"


async def ok_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"served"})


def client(guard: EngineGuard) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://e")


#: vLLM's own VLLM_API_KEY check covers /v1, /v2, /inference and /cohere only: the rest of
#: these (SageMaker's /invocations serves completions, kv_transfer_params and all) it leaves
#: open.
GUARDED = ["/v1/completions", "/v1/chat/completions", "/invocations", "/tokenize",
           "/reset_prefix_cache", "/pause", "/abort_requests", "/kv_event_sources", "/sleep",
           "/v1/models", "/version", "/"]


@pytest.mark.parametrize("path", GUARDED)
async def test_every_path_but_health_and_metrics_needs_the_key(path):
    async with client(EngineGuard(ok_app, key=KEY)) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            r = await c.post(path, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
        r = await c.post(path, headers={"Authorization": f"Bearer {KEY}"})
        assert (r.status_code, r.text) == (200, "served")


async def test_the_proxys_probes_need_no_key():
    async with client(EngineGuard(ok_app, key=KEY)) as c:
        for path in sorted(OPEN_PATHS):
            assert (await c.get(path)).status_code == 200


async def test_no_key_fails_closed(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    async with client(EngineGuard(ok_app)) as c:
        assert (await c.post("/v1/completions", headers={"Authorization": "Bearer "})
                ).status_code == 401
        assert (await c.get("/health")).status_code == 200


async def test_the_key_comes_from_vllms_variable(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    async with client(EngineGuard(ok_app)) as c:
        assert (await c.post("/tokenize", headers={"Authorization": f"Bearer {KEY}"})
                ).status_code == 200


async def test_a_websocket_without_the_key_is_closed():
    sent = []

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    await EngineGuard(ok_app, key=KEY)({"type": "websocket", "path": "/v1/realtime",
                                        "headers": []}, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008}]


def spec(**kw) -> EngineSpec:
    return EngineSpec(role="prefill", model="/m", served_model_name="m", port=8100,
                      side_channel_port=5600, kv_events_port=5700, **kw)


def test_the_key_goes_by_environment_never_the_command_line(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "the-launchers-own")
    s = spec(api_key=KEY)
    argv = engine_argv(s)
    assert not any(KEY in a for a in argv)  # ps shows every user the command line
    assert argv[argv.index("--middleware") + 1] == "launch.engine_guard.EngineGuard"
    assert engine_env(s)[KEY_ENV] == KEY
    assert KEY not in repr(s)
    open_spec = spec()  # no key: no guard, and not the launcher's key either
    assert "--middleware" not in engine_argv(open_spec)
    assert KEY_ENV not in engine_env(open_spec)


def test_the_proxy_config_never_prints_its_keys():
    config = ProxyConfig(served_model_names=("m",), decode_urls=("http://127.0.0.1:1",),
                         policy="local", api_key="client-key", engine_key=KEY)
    assert KEY not in repr(config) and "client-key" not in repr(config)


def test_kv_events_of_a_loopback_engine_go_over_a_private_unix_socket():
    s = spec(host="127.0.0.1")
    assert s.kv_events_endpoint == s.kv_events_bind == (
        f"ipc://{private_socket_dir()}/kv-events-5700")
    argv = engine_argv(s)
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config["endpoint"] == s.kv_events_bind
    mode = private_socket_dir().stat().st_mode
    assert stat.S_IMODE(mode) == 0o700


def test_kv_events_of_a_node_address_engine():
    s = spec(host="10.1.2.3")
    assert s.kv_events_endpoint == "tcp://10.1.2.3:5700"
    assert s.kv_events_bind == "tcp://*:5700"  # vLLM binds only a wildcard TCP address


def test_a_socket_dir_others_may_enter_is_refused(tmp_path):
    planted = tmp_path / f"pdserve-{os.getuid()}"
    planted.mkdir(mode=0o700)
    planted.chmod(0o755)
    with pytest.raises(PermissionError, match="0700"):
        private_socket_dir(tmp_path)
    planted.chmod(0o700)
    assert private_socket_dir(tmp_path) == planted


def test_a_unix_socket_in_use_is_refused(tmp_path):
    path = tmp_path / "kv-events-5700"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen()
        with pytest.raises(PortBusy, match="kv-events-5700"):
            check_endpoints_free([("prefill KV events", f"ipc://{path}")])
    check_endpoints_free([("prefill KV events", f"ipc://{path}")])  # stale file: free
