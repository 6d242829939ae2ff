"""The engines' door: every path of an engine's HTTP server needs the deployment's secret,
except the two the proxy probes without it (``/health``, ``/metrics``).

vLLM's own check (``VLLM_API_KEY``) guards ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
only. Its other routes are open: ``/invocations`` (SageMaker's entry, which serves
completions and chat, ``kv_transfer_params`` included), ``/tokenize``, ``/pause``,
``/abort_requests``, and the dev endpoints when they are on. This ASGI middleware, loaded into
each engine with vLLM's ``--middleware`` (``launch/engines.py``), closes them all with the same
key, read from the same environment variable: the key never appears on a command line, where
every local user could read it through ``ps``.

A missing key fails closed: only the open paths answer.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

#: The variable vLLM reads its API key from; the launcher sets it for each engine process.
KEY_ENV = "VLLM_API_KEY"
#: An operator's (or a test harness's) own key for a deployment, from the launcher's
#: environment; unset, each start makes a fresh one.
DEPLOYMENT_KEY_ENV = "PDSERVE_ENGINE_KEY"
#: What the proxy reads without the key: its health probe and the load it routes on.
OPEN_PATHS = frozenset({"/health", "/metrics"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_DENIED = json.dumps({"error": {
    "message": "this engine serves its deployment's proxy only: send the deployment's key "
               "as 'Authorization: Bearer <key>'",
    "type": "authentication_error", "param": None, "code": 401}}).encode()


def deployment_key() -> str:
    """The secret a deployment's proxy sends its engines (``$PDSERVE_ENGINE_KEY``, else new)."""
    return os.environ.get(DEPLOYMENT_KEY_ENV) or secrets.token_urlsafe(32)


class EngineGuard:
    """Pure ASGI middleware (``vllm ... --middleware launch.engine_guard.EngineGuard``)."""

    def __init__(self, app: ASGIApp, key: str | None = None) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV) if key is None else key
        self._expected = f"Bearer {key}".encode() if key else None

    def allows(self, scope: Scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS:
            return True
        if self._expected is None:
            return False
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allows(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
        else:
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(_DENIED)).encode()),
                (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": _DENIED})
