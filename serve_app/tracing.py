"""OpenTelemetry traces of requests (optional: `pip install jax-serve[otel]`, `otlp_traces_endpoint`).

One trace per request, continuing the client's W3C trace context (`traceparent` header) when it
sends one:

    POST /v1/chat/completions          the ingress (SpanKind.SERVER): route, model, HTTP status
      generate                         the model-server replica: model, adapter, choices
        engine_request                 one per engine request (choice): tokens, cached tokens,
          queued                         finish reason; its phases from the engine's timestamps:
          prefill                        waiting for a batch slot, reading the prompt up to the
          decode                         first token, the tokens after it

The ingress passes its span's context to the replica in the request's `RequestContext.trace` (the
W3C headers as a dict), so the trace crosses the Ray hop. Each process makes its own tracer
provider (no global one is set) exporting over OTLP/HTTP in batches; `Tracing.to(exporter)` sends
spans to any SDK exporter instead (tests: the in-memory one). Without an endpoint, `Tracing.off()`
does nothing and imports nothing.
"""

from __future__ import annotations

from typing import Any, Optional


class Tracing:
    """A tracer, or nothing (every method then does nothing)."""

    def __init__(self, tracer: Any = None):
        self._tracer = tracer

    @staticmethod
    def off() -> "Tracing":
        return Tracing()

    @staticmethod
    def to_endpoint(endpoint: Optional[str], service: str) -> "Tracing":
        """Spans exported over OTLP/HTTP to `endpoint` (e.g. http://collector:4318/v1/traces); off
        without one."""
        if not endpoint:
            return Tracing.off()
        try:  # optional (jax-serve[otel]): imported once tracing is on, refused with the fix when missing
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise ValueError("otlp_traces_endpoint needs OpenTelemetry: pip install 'jax-serve[otel]'") from exc
        return Tracing._with(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)), service)

    @staticmethod
    def to(exporter, service: str) -> "Tracing":
        """Spans handed to `exporter` as each ends (an SDK SpanExporter)."""
        # optional (jax-serve[otel]), imported once tracing is on
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        return Tracing._with(SimpleSpanProcessor(exporter), service)

    @staticmethod
    def _with(processor, service: str) -> "Tracing":
        # optional (jax-serve[otel]), imported once tracing is on
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(processor)
        return Tracing(provider.get_tracer("jax-serve"))

    def start(self, name: str, parent: Optional[dict[str, str]] = None, server: bool = False, **attributes) -> Any:
        """A started span (None when off), child of the W3C context in the headers `parent` (none:
        a new trace); the caller ends it."""
        if self._tracer is None:
            return None
        # optional (jax-serve[otel]), imported once tracing is on
        from opentelemetry.trace import SpanKind

        kind = SpanKind.SERVER if server else SpanKind.INTERNAL
        return self._tracer.start_span(name, context=_extract(parent), kind=kind, attributes=_clean(attributes))

    def child(self, name: str, parent_span: Any, start_s: float, end_s: float, **attributes) -> Any:
        """A span of `parent_span` from `start_s` to `end_s` (wall-clock seconds), made after the fact."""
        if self._tracer is None or parent_span is None:
            return None
        # optional (jax-serve[otel]), imported once tracing is on
        from opentelemetry import trace

        span = self._tracer.start_span(name, context=trace.set_span_in_context(parent_span),
                                       start_time=_ns(start_s), attributes=_clean(attributes))
        span.end(end_time=_ns(max(start_s, end_s)))
        return span


def headers_of(span: Any) -> dict[str, str]:
    """The W3C trace context headers naming `span` as the parent ({} without one)."""
    if span is None:
        return {}
    # optional (jax-serve[otel]), imported once tracing is on
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import (
        TraceContextTextMapPropagator,
    )

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def set_attributes(span: Any, **attributes) -> None:
    if span is not None:
        span.set_attributes(_clean(attributes))


def set_http_status(span: Any, status: int) -> None:
    """Record the HTTP status a span's request was answered with (a 5xx marks the span failed)."""
    if span is None:
        return
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        # optional (jax-serve[otel]), imported once tracing is on
        from opentelemetry.trace import StatusCode

        span.set_status(StatusCode.ERROR)


def _extract(headers: Optional[dict[str, str]]):
    """The context of the W3C headers (an empty one, so a new trace, without them)."""
    # optional (jax-serve[otel]), imported once tracing is on
    from opentelemetry.context import Context
    from opentelemetry.trace.propagation.tracecontext import (
        TraceContextTextMapPropagator,
    )

    carrier = {k.lower(): v for k, v in (headers or {}).items()}
    return TraceContextTextMapPropagator().extract(carrier, context=Context())


def _clean(attributes: dict) -> dict:
    return {k: v for k, v in attributes.items() if v is not None}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
