"""Traces across the process boundary: how each process (the API, an engine worker) exports
its spans over OTLP/HTTP, and the trace context an op carries from one to the other.

Tracing is off unless an endpoint is given (`--otel-endpoint`, or the standard
OTEL_EXPORTER_OTLP_ENDPOINT) and the OpenTelemetry SDK is installed (`treadle[otel]`).
When it is off nothing here runs on the path of a request: `tracer()` is None, an op's
`trace` stays None, and its message carries a nil.

An op carries the W3C `traceparent` of the HTTP request that filed it (Op.trace). The
worker makes the span of the engine call an op ran in as a child of that request's span,
with a link to each other request of the same call (treadle.worker.loop): the one place
that knows which requests shared a call, and when it began and ended, is the worker.

    provider = setup("http://collector:4318", "treadle-worker")   # once per process
    tracer()                                                      # None when off
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger("treadle.tracing")

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
INSTRUMENTATION = "treadle"

_lock = threading.Lock()
_provider: Any = None  # this process's TracerProvider, once set up
_tracer: Any = None


def endpoint_of(configured: str | None) -> str | None:
    """The OTLP/HTTP endpoint to export to: the configured one, else the standard variable."""
    return configured or os.environ.get(ENDPOINT_ENV) or None


def setup(endpoint: str | None, service_name: str) -> Any:
    """Export this process's spans to `endpoint` (OTLP/HTTP, `/v1/traces` added when the
    URL has no path): → the TracerProvider, or None (no endpoint, or no SDK). Once per
    process: a worker thread of the API process shares the API's provider."""
    global _provider, _tracer
    if not endpoint:
        return None
    with _lock:
        if _provider is not None:
            return _provider
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            log.warning(
                "traces to %s: the OpenTelemetry SDK is not installed "
                "(pip install 'treadle[otel]'); tracing stays off",
                endpoint,
            )
            return None
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        url = endpoint.rstrip("/")
        if url.count("/") <= 2:  # scheme://host:port: the standard path of traces
            url += "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        _provider, _tracer = provider, provider.get_tracer(INSTRUMENTATION)
        log.info("traces go to %s as %s", url, service_name)
        return provider


def tracer() -> Any:
    """This process's tracer, or None when tracing is off."""
    return _tracer


def shutdown() -> None:
    """Export what is left (a worker's last spans, before it exits)."""
    global _provider, _tracer
    with _lock:
        provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def traceparent(span: Any) -> str:
    """A span's W3C traceparent header value."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def span_context(header: str | None) -> Any:
    """The (remote) SpanContext a traceparent names, or None if it names none."""
    if not header:
        return None
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    parts = header.split("-")
    if len(parts) != 4:
        return None
    try:
        ctx = SpanContext(int(parts[1], 16), int(parts[2], 16), True, TraceFlags(int(parts[3], 16)))
    except ValueError:
        return None
    return ctx if NonRecordingSpan(ctx).get_span_context().is_valid else None


def parent_of(header: str | None) -> Any:
    """An OpenTelemetry Context whose parent is the span a traceparent names (or None)."""
    ctx = span_context(header)
    if ctx is None:
        return None
    from opentelemetry.trace import NonRecordingSpan, set_span_in_context

    return set_span_in_context(NonRecordingSpan(ctx))
