"""One trace per request across the proxy and both engines (OpenTelemetry, exported by OTLP).

Off unless ``otlp_traces_endpoint`` is configured: then no tracer provider or exporter exists,
``ApiRequest.spans`` is None, and each stage pays one ``is None`` test.

On, a request admitted by the proxy gets a root span (``pdserve.request``, from its arrival
to its last byte) with children for its stages: ``admission``, ``tokenize``, ``decision``,
``prefill``, ``handover``, ``decode`` (sent -> first byte) and ``relay``. The calls to the
engines carry the W3C ``traceparent`` of the ``prefill`` / ``decode`` span, so an engine
started with vLLM's ``--otlp-traces-endpoint`` makes its own ``llm_request`` span their child:
one trace id from the client's request to both engines. Every span carries the request id,
the route and the engines: the stages that end before the decision (``admission``,
``tokenize``) are held and exported at the request's end with the route it took and the
engines that served it (:meth:`RequestSpans.annotate`). A stream continued on another decode
engine (migration) adds that continuation's stages to the same trace. A request refused before
admission (a 4xx, or 503 at capacity) is a trace of one span, ``pdserve.request`` with its
status and error type (:meth:`Tracing.refused`); one that fails later gets both on its root.

Stage spans are recorded after the fact from the timestamps the proxy takes anyway
(``time.perf_counter``); only the two engine calls open theirs live, to have a context to send.
"""

from __future__ import annotations

import os
import time
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

#: ``time.perf_counter()`` seconds -> the epoch nanoseconds spans are stamped with.
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()
_PROPAGATOR = TraceContextTextMapPropagator()
#: What a held stage learns from the request's end: where it ran.
_HELD_GET = frozenset({"route", "prefill", "decode"})


def epoch_ns(perf_s: float) -> int:
    return int(perf_s * 1e9) + _EPOCH_OFFSET_NS


def _exporter(endpoint: str) -> Any:
    """The OTLP exporter vLLM's engines use for the same endpoint (same protocol variable)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"unsupported OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r}")


class Tracing:
    """The proxy's tracer: exists only when an endpoint is configured."""

    def __init__(self, endpoint: str, exporter: Any = None):
        self._provider = TracerProvider(resource=Resource.create({"service.name": "pdserve"}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter or _exporter(endpoint)))
        self._tracer = self._provider.get_tracer("pdserve.proxy")

    def request(self, request_id: str, endpoint: str, t_arrival: float) -> RequestSpans:
        root = self._tracer.start_span("pdserve.request", start_time=epoch_ns(t_arrival),
                                       attributes={"pd.request_id": request_id,
                                                   "pd.endpoint": endpoint})
        return RequestSpans(self._tracer, root, request_id)

    def refused(self, request_id: str, endpoint: str, t_arrival: float, status: int,
                error_type: str) -> None:
        """A request answered with an error before admission: one span, its whole life."""
        root = self._tracer.start_span("pdserve.request", start_time=epoch_ns(t_arrival),
                                       attributes={"pd.request_id": request_id,
                                                   "pd.endpoint": endpoint, "pd.status": status,
                                                   "pd.error_type": error_type})
        root.set_status(Status(StatusCode.ERROR, error_type))
        root.end()

    def shutdown(self) -> None:
        self._provider.shutdown()  # flushes what is still queued


class RequestSpans:
    """One request's trace: its root span and the stages under it."""

    def __init__(self, tracer: Any, root: Span, request_id: str):
        self._tracer = tracer
        self._root = root
        self._context = set_span_in_context(root)
        self._request_id = request_id
        self._ended = False
        #: What the root says of the request so far (route, engines): what held stages get.
        self._known: dict[str, Any] = {}
        #: Stages finished before the decision, exported at :meth:`end` with what is known.
        self._held: list[tuple[str, float, float, dict[str, Any]]] = []

    def stage(self, name: str, t0: float, t1: float, **attributes: Any) -> None:
        """A finished stage, from ``perf_counter`` times."""
        span = self._tracer.start_span(name, context=self._context, start_time=epoch_ns(t0),
                                       attributes=self._attributes(attributes))
        span.end(end_time=epoch_ns(t1))

    def hold(self, name: str, t0: float, t1: float, **attributes: Any) -> None:
        """A stage finished before the route is known: exported at :meth:`end` with the
        route and engines the request ended with."""
        self._held.append((name, t0, t1, attributes))

    def call(self, name: str, t0: float, headers: dict[str, str], **attributes: Any) -> Span:
        """A stage that calls an engine, open from ``t0``: ``headers`` get its traceparent.
        The caller ends it with :meth:`finish`."""
        span = self._tracer.start_span(name, context=self._context, start_time=epoch_ns(t0),
                                       attributes=self._attributes(attributes))
        _PROPAGATOR.inject(headers, context=set_span_in_context(span))
        return span

    def finish(self, span: Span, t_end: float, **attributes: Any) -> None:
        """End a :meth:`call` span at ``t_end``."""
        span.set_attributes(self._attributes(attributes))
        span.end(end_time=epoch_ns(t_end))

    def decided(self, **attributes: Any) -> None:
        """The decision's route and engines: what held stages get unless the request ends
        otherwise (:meth:`annotate`)."""
        self._known.update((k, v) for k, v in attributes.items() if k in _HELD_GET)

    def annotate(self, **attributes: Any) -> None:
        """What is now known of the whole request: on the root; its route and engines (None:
        no such engine) on the held stages too."""
        self._known.update((k, v) for k, v in attributes.items() if k in _HELD_GET)
        self._root.set_attributes(self._attributes(attributes))

    def failed(self, status: int, error_type: str) -> None:
        self.annotate(status=status, error_type=error_type)
        self._root.set_status(Status(StatusCode.ERROR, error_type))

    def end(self, t_end: float | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        for name, t0, t1, attributes in self._held:
            self.stage(name, t0, t1, **{**self._known, **attributes})
        self._held.clear()
        self._root.end(end_time=epoch_ns(t_end if t_end is not None else time.perf_counter()))

    def _attributes(self, attributes: dict[str, Any]) -> dict[str, Any]:
        out = {"pd.request_id": self._request_id}
        out.update((f"pd.{k}", v) for k, v in attributes.items() if v is not None)
        return out

