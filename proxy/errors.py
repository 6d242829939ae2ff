"""One error tree, one table from error to HTTP status, one function that builds the body.

    ProxyError
    ├── ClientError (4xx)
    │   ├── InvalidRequest        400 invalid_request_error
    │   ├── Unauthorized          401 authentication_error
    │   ├── ModelNotFound         404 not_found_error
    │   ├── RouteNotFound         404 not_found_error
    │   ├── MethodNotAllowed      405 invalid_request_error
    │   ├── RequestTimeout        408 invalid_request_error (body not received in time)
    │   ├── PayloadTooLarge       413 invalid_request_error
    │   ├── UnsupportedMediaType  415 invalid_request_error
    │   └── HeadersTooLarge       431 invalid_request_error
    └── ServerError (5xx)
        ├── InternalError         500 internal_error     (a bug of ours; logged, never shown)
        ├── UpstreamError         502 upstream_error     (an engine failed or answered garbage)
        │   └── DecodeLost        (the decode engine failed after it had answered)
        ├── Overloaded            503 overloaded_error   (admission control; carries Retry-After)
        ├── NoEngineAvailable     503 service_unavailable
        └── StageTimeout          504 timeout_error      (a stage missed its deadline)
            ├── DecodeStalled     (the decode engine went silent after it had answered)
            └── RequestDeadline   (the whole request ran past --total-deadline-s)

Messages are written for clients: they never carry stack traces or engine internals.
"""

from __future__ import annotations

import json
from typing import Any


class ProxyError(Exception):
    status = 500
    type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def headers(self) -> dict[str, str]:
        return {}


class ClientError(ProxyError):
    status = 400
    type = "invalid_request_error"


class InvalidRequest(ClientError):
    pass


class Unauthorized(ClientError):
    status = 401
    type = "authentication_error"


class ModelNotFound(ClientError):
    status = 404
    type = "not_found_error"


class RequestTimeout(ClientError):
    status = 408


class PayloadTooLarge(ClientError):
    status = 413


class UnsupportedMediaType(ClientError):
    status = 415


class HeadersTooLarge(ClientError):
    status = 431


class RouteNotFound(ClientError):
    status = 404
    type = "not_found_error"


class MethodNotAllowed(ClientError):
    status = 405


class ServerError(ProxyError):
    status = 500
    type = "internal_error"


class InternalError(ServerError):
    """A bug of ours: nothing a client sent or an engine did explains it."""


class UpstreamError(ServerError):
    status = 502
    type = "upstream_error"


class Overloaded(ServerError):
    status = 503
    type = "overloaded_error"

    def __init__(self, message: str, *, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after_s)}


class NoEngineAvailable(ServerError):
    status = 503
    type = "service_unavailable"


class StageTimeout(ServerError):
    status = 504
    type = "timeout_error"


class DecodeLost(UpstreamError):
    """``engine`` failed mid-answer: what it sent stands, the rest may continue elsewhere."""

    def __init__(self, message: str, *, engine: str):
        super().__init__(message)
        self.engine = engine


class DecodeErrored(DecodeLost):
    """``engine`` reported its own failure mid-answer (an in-band 5xx error event)."""


class DecodeStalled(StageTimeout):
    """``engine`` sent nothing past the idle deadline mid-answer."""

    def __init__(self, message: str, *, engine: str):
        super().__init__(message)
        self.engine = engine


class RequestDeadline(StageTimeout):
    """The whole request ran past its deadline: it ends here, wherever it is (never continued
    on another engine: the deadline is the client's, not the engine's)."""


def error_body(err: ProxyError) -> dict[str, Any]:
    """The OpenAI-style error object for ``err``."""
    return {
        "error": {
            "message": err.message,
            "type": err.type,
            "param": err.param,
            "code": err.code if err.code is not None else err.status,
        }
    }


def error_json(err: ProxyError) -> bytes:
    return json.dumps(error_body(err)).encode()


def error_sse(err: ProxyError) -> bytes:
    """An in-band error for a stream that has already started, followed by the terminator."""
    return b"data: " + error_json(err) + b"\n\ndata: [DONE]\n\n"


def from_engine_error(status: int, body: bytes) -> ProxyError:
    """Map an engine's 4xx reply to our tree, keeping the engine's client-facing message."""
    message = "the engine rejected the request"
    param = None
    try:
        parsed = json.loads(body)
        inner = parsed.get("error", parsed)
        message = str(inner.get("message") or message)
        param = inner.get("param")
    except (ValueError, AttributeError):
        pass
    if status == 404:
        return ModelNotFound(message, param=param)
    if status == 413:
        return PayloadTooLarge(message, param=param)
    if 400 <= status < 500:
        return InvalidRequest(message, param=param)
    return UpstreamError("an engine failed to serve the request")
