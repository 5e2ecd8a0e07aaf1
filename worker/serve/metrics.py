"""Prometheus metrics of an inference server, read from its counters at scrape time.

Nothing is recorded through prometheus_client on the request path: ParallelInference keeps its own counters
and histograms (one lock per batch) and the server counts HTTP outcomes on its event loop; this collector turns
them into metric families when /metrics is scraped. Each server has its own CollectorRegistry, so several
servers can live in one process (tests do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from tandem.worker.serve.stats import LATENCY_BUCKETS, batch_sizes

OUTCOMES = ("success", "rejected", "failed", "invalid")


class ServerCollector:
    """Reads `state()` at scrape time: a dict with `model`, `outcomes` (HTTP requests by outcome), `stats`
    (InferenceStats.snapshot(), or None before the model is loaded), `pending`, `ready`, `batching` (the
    BatchingSettings run with) and `batch_limits` (every batch limit run with: the batch-size histogram has a bucket
    for each, so that a change adds buckets and never moves counts between them)."""

    def __init__(self, state: Callable[[], dict[str, Any]]):
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        model = state["model"]
        requests = CounterMetricFamily(
            "tandem_inference_requests", "Inference requests by outcome: success, rejected (queue full, 429), "
            "failed (model error, timeout, shutting down), invalid (4xx: bad request)", labels=["model", "outcome"])
        for outcome in OUTCOMES:
            requests.add_metric([model, outcome], state["outcomes"][outcome])
        yield requests
        yield _gauge("tandem_inference_pending_requests", "Inference requests received and not yet answered",
                     model, state["pending"])
        yield _gauge("tandem_inference_ready", "1 when the model is loaded, warmed up and the server accepts requests",
                     model, 1 if state["ready"] else 0)
        batching = state["batching"]
        yield _gauge("tandem_inference_batch_limit", "Most examples in one forward pass (the pool's batchLimit, as "
                     "this server runs it)", model, batching.batch_limit)
        yield _gauge("tandem_inference_queue_limit", "Most requests waiting before new ones are refused (429)",
                     model, batching.queue_limit)
        yield _gauge("tandem_inference_max_queue_delay_seconds", "How long a batch may wait to fill", model,
                     batching.max_queue_delay_microseconds / 1e6)
        yield _gauge("tandem_inference_request_timeout_seconds", "How long a request may take before it is answered "
                     "504", model, batching.request_timeout_ms / 1000)
        stats = state["stats"]
        if stats is None:
            return
        yield _counter("tandem_inference_examples", "Examples inferred (Triton's inference count)", model,
                       stats["inference_count"])
        yield _counter("tandem_inference_executions", "Forward passes run (Triton's execution count); examples / "
                       "executions is the mean batch size", model, stats["execution_count"])
        yield _histogram("tandem_inference_queue_duration_seconds", "Time requests waited for a worker", model,
                         LATENCY_BUCKETS, stats["queue_histogram"], stats["queue_ns"] / 1e9)
        compute_ns = stats["compute_input_ns"] + stats["compute_infer_ns"] + stats["compute_output_ns"]
        yield _histogram("tandem_inference_compute_duration_seconds", "Time of the forward pass (with input "
                         "batching and output splitting) that answered each request", model, LATENCY_BUCKETS,
                         stats["compute_histogram"], compute_ns / 1e9)
        bounds = sorted({size for limit in state["batch_limits"] for size in batch_sizes(limit)})
        counts = [0] * (len(bounds) + 1)
        for size, (executions, *_) in stats["batches"].items():
            counts[next((i for i, bound in enumerate(bounds) if size <= bound), len(bounds))] += executions
        yield _histogram("tandem_inference_batch_size", "Examples per forward pass", model, bounds, counts,
                         float(stats["inference_count"]))


def _gauge(name: str, documentation: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["model"])
    family.add_metric([model], value)
    return family


def _counter(name: str, documentation: str, model: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=["model"])
    family.add_metric([model], value)
    return family


def _histogram(name: str, documentation: str, model: str, bounds, counts: list[int],
               total: float) -> HistogramMetricFamily:
    cumulative, running = [], 0
    for bound, count in zip(bounds, counts, strict=False):
        running += count
        cumulative.append((_bound(bound), running))
    cumulative.append(("+Inf", running + sum(counts[len(bounds):])))
    family = HistogramMetricFamily(name, documentation, labels=["model"])
    family.add_metric([model], cumulative, sum_value=total)
    return family


def _bound(value: float) -> str:
    return repr(float(value))


def registry_for(state: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    """A registry of its own for one server: its metrics and the process's."""
    registry = CollectorRegistry()
    registry.register(ServerCollector(state))
    ProcessCollector(registry=registry)
    return registry
