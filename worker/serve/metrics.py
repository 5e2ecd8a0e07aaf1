"""Prometheus metrics of an inference server, read from its counters at scrape time.

Nothing is recorded through prometheus_client on the request path: ParallelInference keeps its own counters
and histograms (one lock per batch) and the server counts HTTP outcomes on its event loop; this collector turns
them into metric families when /metrics is scraped, summed over the pod's server processes (merge_states). Each
scrape has a CollectorRegistry of its own, so several servers can live in one process (tests do). The process_*
metrics are those of the process that answered the scrape.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from tandem.worker.serve.stats import LATENCY_BUCKETS, batch_sizes, merge_snapshots

OUTCOMES = ("success", "rejected", "failed", "invalid")


class ServerCollector:
    """Turns `state` into metric families: a dict with `model`, `outcomes` (requests by outcome), `stats`
    (InferenceStats.snapshot(), or None before the model is loaded), `pending`, `ready`, `batching` (the
    BatchingSettings run with) and `batch_limits` (every batch limit run with: the batch-size histogram has a bucket
    for each, so that a change adds buckets and never moves counts between them)."""

    def __init__(self, state: dict[str, Any]):
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state
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


def registry_for(state: dict[str, Any]) -> CollectorRegistry:
    """A registry of its own for one scrape: the server's metrics and the process's."""
    registry = CollectorRegistry()
    registry.register(ServerCollector(state))
    ProcessCollector(registry=registry)
    return registry


def exposition(state: dict[str, Any]) -> bytes:
    """/metrics' body (Prometheus' text format) for `state` (ServerCollector's)."""
    return generate_latest(registry_for(state))


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The states (Routes.local_state) of a pod's server processes as one: requests and pending ones summed, ready
    when all are, statistics summed over the processes that have loaded their model (None before any has), every
    batch limit any ran with."""
    snapshots = [state["stats"] for state in states if state["stats"] is not None]
    return {
        "outcomes": {outcome: sum(state["outcomes"][outcome] for state in states) for outcome in OUTCOMES},
        "pending": sum(state["pending"] for state in states),
        "ready": all(state["ready"] for state in states),
        "stats": merge_snapshots(snapshots) if snapshots else None,
        "batch_limits": sorted({limit for state in states for limit in state["batch_limits"]}),
    }
