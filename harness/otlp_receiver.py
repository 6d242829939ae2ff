"""An OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` (protobuf), spans kept in memory.
What an OpenTelemetry collector would get from the proxy and the engines
(``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name, else vLLM's instrumenting module name
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                request = ExportTraceServiceRequest.FromString(body)
                receiver._add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.endpoint = f"http://{host}:{self._server.server_port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        got = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = res.get("service.name") or ""
            if service in ("", "unknown_service"):
                service = str(res.get("vllm.instrumenting_module_name", service))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        s.start_time_unix_nano, s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes}))
        with self._lock:
            self.spans.extend(got)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return sorted((s for s in self.spans if s.trace_id == trace_id),
                          key=lambda s: s.start_ns)

    def request_trace(self, request_id: str, engine_spans: int = 2,
                      timeout_s: float = 60.0) -> list[ReceivedSpan]:
        """The trace of the proxy's request ``request_id`` once it holds ``engine_spans`` of
        the engines' own spans (``llm_request``); fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                roots = [s for s in self.spans if s.name == "pdserve.request"
                         and s.attributes.get("pd.request_id") == request_id]
            if roots:
                spans = self.trace(roots[0].trace_id)
                if sum(s.name == "llm_request" for s in spans) >= engine_spans:
                    return spans
            if time.monotonic() > deadline:
                with self._lock:
                    seen = [s.name for s in self.spans][-40:]
                raise AssertionError(f"no trace of {request_id} with {engine_spans} engine "
                                     f"spans within {timeout_s} s; last spans: {seen}")
            time.sleep(0.2)
