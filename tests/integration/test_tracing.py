"""OpenTelemetry traces (serve_app.tracing) through the OpenAI app and the real engine in this
process, collected by the SDK's in-memory exporter: one trace per request continuing the client's
`traceparent`, the ingress's span over the replica's, over one span per engine request with its
queued, prefill and decode phases."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serve_app.tracing import Tracing
from tests.support.serving_helpers import app_in_process

MODEL = "tiny-llama"
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture(scope="module")
def traced(llama_dir):
    exporter = InMemorySpanExporter()
    with app_in_process(llama_dir, MODEL, tracing=Tracing.to(exporter, "test"), max_num_seqs=4) as (_, http, client):
        yield exporter, http, client


def spans_by_name(exporter) -> dict[str, list]:
    found: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        found.setdefault(span.name, []).append(span)
    return found


def test_a_request_is_one_trace_continuing_the_clients(traced):
    exporter, http, _ = traced
    exporter.clear()
    answer = http.post("/v1/completions", headers={"traceparent": TRACEPARENT},
                       json={"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0})
    assert answer.status_code == 200
    spans = spans_by_name(exporter)
    assert sorted(spans) == ["POST /v1/completions", "decode", "engine_request", "generate", "prefill", "queued"]
    assert all(len(found) == 1 for found in spans.values())
    ingress, generate, engine = spans["POST /v1/completions"][0], spans["generate"][0], spans["engine_request"][0]
    assert {format(s.context.trace_id, "032x") for found in spans.values() for s in found} == {TRACE_ID}
    assert format(ingress.parent.span_id, "016x") == PARENT_ID
    assert generate.parent.span_id == ingress.context.span_id
    assert engine.parent.span_id == generate.context.span_id
    queued, prefill, decode = spans["queued"][0], spans["prefill"][0], spans["decode"][0]
    assert {s.parent.span_id for s in (queued, prefill, decode)} == {engine.context.span_id}
    assert engine.start_time == queued.start_time <= queued.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time <= decode.end_time == engine.end_time
    assert ingress.start_time <= generate.start_time <= engine.start_time and engine.end_time <= ingress.end_time
    assert ingress.attributes["http.response.status_code"] == 200
    assert ingress.attributes["gen_ai.request.model"] == generate.attributes["gen_ai.request.model"] == MODEL
    usage = answer.json()["usage"]
    assert (engine.attributes["gen_ai.usage.input_tokens"], engine.attributes["gen_ai.usage.output_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"]) == (4, 5)
    assert engine.attributes["gen_ai.response.finish_reasons"] == ("length",)


def test_a_streamed_request_with_two_choices_ends_its_spans_after_the_stream(traced):
    exporter, _, client = traced
    exporter.clear()
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                            max_tokens=4, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks
    spans = spans_by_name(exporter)
    ingress, generate = spans["POST /v1/chat/completions"][0], spans["generate"][0]
    assert len(spans["engine_request"]) == 2 and len(spans["decode"]) == 2
    assert ingress.parent is None  # no traceparent: a trace of its own
    assert generate.attributes["jax_serve.choices"] == 2 and generate.attributes["jax_serve.stream"] is True
    assert max(s.end_time for s in spans["engine_request"]) <= generate.end_time <= ingress.end_time


def test_a_refused_request_is_a_span_with_its_status_and_nothing_below(traced):
    exporter, http, _ = traced
    exporter.clear()
    answer = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": -1})
    assert answer.status_code == 400
    spans = spans_by_name(exporter)
    assert list(spans) == ["POST /v1/completions"]
    assert spans["POST /v1/completions"][0].attributes["http.response.status_code"] == 400
