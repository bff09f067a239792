"""Prometheus metrics with vLLM's names, computed in each model-server replica, and
one info metric of our own, `jax_serve:engine_info` (like vLLM's `cache_config_info`: value 1, the
engine's description as labels: attention backend, dtypes, tensor_parallel_size, devices, mesh).

Each `ServerMetrics` owns its registry (no process-global state). Request metrics are recorded by a
`RequestTracker` per engine request (one per choice); engine gauges and counters are read from
`EngineStats` at scrape time. Every sample carries `model_name` and `replica` labels, so series
from different replicas never collide when the ingress renders them together (serve_app.http.metrics).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Optional

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from engine.stats import EngineStats

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)



class ServerMetrics:
    """The metrics of one model-server replica."""

    def __init__(self, model_name: str, replica: str, stats: Callable[[], EngineStats], engine_info: dict[str, str]):
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name, "replica": replica}
        info = {**self._labels, **engine_info}
        Gauge("jax_serve:engine_info", "How the replica runs its model (value 1): attention backend, dtypes, "
              "tensor_parallel_size, devices, mesh, KV pool.", list(info), registry=self.registry).labels(**info).set(1)
        self.time_to_first_token = self._histogram(
            "vllm:time_to_first_token_seconds", "Time from arrival to the first output token.", LATENCY_BUCKETS
        )
        self.inter_token_latency = self._histogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", LATENCY_BUCKETS
        )
        self.e2e_request_latency = self._histogram(
            "vllm:e2e_request_latency_seconds", "Time from arrival to the last output token.", REQUEST_BUCKETS
        )
        self.request_queue_time = self._histogram(
            "vllm:request_queue_time_seconds",
            "Time from arrival at the ingress to submission to the engine (Ray Serve's queue).",
            LATENCY_BUCKETS,
        )
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Tokens generated.")
        self._success = Counter(
            "vllm:request_success",
            "Finished engine requests, by finish reason.",
            [*self._labels, "finished_reason"],
            registry=self.registry,
        )
        self.stats = stats
        """The engine's latest `EngineStats` (cheap: a snapshot)."""
        self.registry.register(_EngineStatsCollector(self._labels, stats))

    def families(self) -> list[Metric]:
        """A snapshot of every metric family (picklable, for the ingress)."""
        return list(self.registry.collect())

    def track(self, request_id: str, arrival_time: float) -> "RequestTracker":
        return RequestTracker(self, request_id, arrival_time)

    def count_finished(self, reason: str) -> None:
        self._success.labels(**self._labels, finished_reason=reason).inc()

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]):
        return Histogram(name, doc, list(self._labels), buckets=buckets, registry=self.registry).labels(**self._labels)

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, list(self._labels), registry=self.registry).labels(**self._labels)


class RequestTracker:
    """Timestamps of one engine request; `finish` records its metrics and one structured log line."""

    def __init__(self, metrics: ServerMetrics, request_id: str, arrival_time: float):
        self._metrics = metrics
        self._request_id = request_id
        self._arrival = arrival_time
        self._last_token: Optional[float] = None
        self.started = time.time()
        """When the replica began the request (wall-clock seconds)."""
        self.first_token: Optional[float] = None
        """When its first output token arrived, if one did."""
        metrics.request_queue_time.observe(max(0.0, time.time() - arrival_time))

    def on_tokens(self, count: int) -> None:
        if count == 0:
            return
        now = time.time()
        if self._last_token is None:
            self.first_token = now
            self._metrics.time_to_first_token.observe(now - self._arrival)
        else:
            for _ in range(count):
                self._metrics.inter_token_latency.observe((now - self._last_token) / count)
        self._last_token = now
        self._metrics.generation_tokens.inc(count)

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        now = time.time()
        self._metrics.e2e_request_latency.observe(now - self._arrival)
        self._metrics.prompt_tokens.inc(prompt_tokens)
        self._metrics.count_finished(reason)
        ttft = "-" if self.first_token is None else f"{self.first_token - self._arrival:.4f}"
        logger.info(
            "request_done id=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d ttft_s=%s latency_s=%.4f "
            "finish_reason=%s",
            self._request_id,
            prompt_tokens,
            cached_tokens,
            completion_tokens,
            ttft,
            now - self._arrival,
            reason,
        )


class _EngineStatsCollector:
    """Gauges and counters read from the engine's latest `EngineStats` at each scrape."""

    def __init__(self, labels: dict[str, str], stats: Callable[[], EngineStats]):
        self._labels = labels
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        names, values = list(self._labels), list(self._labels.values())
        gauges = {
            "vllm:num_requests_running": ("Requests in the engine's running batch.", stats.num_running),
            "vllm:num_requests_waiting": ("Requests waiting for a batch slot or pages.", stats.num_waiting),
            "vllm:kv_cache_usage_perc": ("Fraction of KV pages held by live requests (0-1).", stats.kv_cache_usage),
            "vllm:last_batch_size": ("Sequences in the engine's most recent step.", stats.last_batch_size),
            "vllm:max_batch_size": ("Most sequences ever run in one engine step.", stats.max_batch_size),
            "jax_serve:compiled_step_programs": ("Step programs compiled so far (the replica serves from the first; "
                                                 "the rest compile in the background).", stats.compiled_programs),
            "jax_serve:step_programs": ("Step programs the replica compiles in all (0: none ahead of use).",
                                        stats.step_programs),
            "jax_serve:lora_adapters": ("LoRA adapters the replica holds read in host memory.", stats.num_adapters),
            "jax_serve:lora_slots_in_use": ("Device LoRA slots pinned by running requests (of max_loras).",
                                            stats.lora_slots_in_use),
        }
        counters = {
            "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            "vllm:num_preemptions": ("Requests preempted for lack of KV pages.", stats.num_preemptions),
            "vllm:engine_steps": ("Engine steps run.", stats.num_steps),
            "vllm:spec_decode_num_drafts": ("Decoding rows that carried guessed tokens (speculative decoding).",
                                            stats.spec_drafts),
            "vllm:spec_decode_num_draft_tokens": ("Guessed tokens checked (speculative decoding).",
                                                  stats.spec_draft_tokens),
            "vllm:spec_decode_num_accepted_tokens": ("Guessed tokens kept: the model sampled the same token "
                                                     "(acceptance rate: accepted / draft tokens).",
                                                     stats.spec_accepted_tokens),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
