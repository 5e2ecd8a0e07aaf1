"""ParallelInference's statistics: counters and histograms kept on its worker threads, read as one snapshot.

Nothing here imports torch or the batching engine: the Prometheus collector (metrics.py) and Triton's
statistics endpoint (triton.py) read snapshots, and ParallelInference (inference.py) records into them.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

# Request latency buckets (seconds) for the queue and compute histograms.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)


def batch_sizes(batch_limit: int) -> list[int]:
    """The powers of two below `batch_limit`, then `batch_limit`: the sizes batched mode is warmed up at, Triton's
    preferred batch sizes, and the bounds of the batch-size histogram."""
    sizes, size = [], 1
    while size < batch_limit:
        sizes.append(size)
        size *= 2
    return [*sizes, batch_limit]


class Submitted(Protocol):
    """A batch's item as the statistics see it: when its requests were submitted (time.perf_counter_ns()), one
    for a Ticket, several for a feed's Bundle."""

    arrivals: Sequence[int]


class InferenceStats:
    """Counters and histograms, updated once per batch under one lock; `snapshot()` reads them consistently.

    Names follow Triton's statistics: a request succeeds or fails; `inference_count` counts examples,
    `execution_count` forwards; queue and compute times are per request (each request in a batch is charged
    the batch's compute time), and `batches` holds, per batch size (examples), how many forwards ran and
    their input/infer/output time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fed: Callable[[], dict[str, int]] | None = None
        self.success_count = self.success_ns = 0
        self.fail_count = self.fail_ns = 0
        self.rejected_count = 0
        self.queue_count = self.queue_ns = 0
        self.compute_count = self.compute_input_ns = self.compute_infer_ns = self.compute_output_ns = 0
        self.inference_count = self.execution_count = 0
        self.last_inference_ms = 0
        self.batches: dict[int, list[int]] = {}
        self.queue_histogram = [0] * (len(LATENCY_BUCKETS) + 1)
        self.compute_histogram = [0] * (len(LATENCY_BUCKETS) + 1)

    def rejected(self) -> None:
        with self._lock:
            self.rejected_count += 1

    def failed_unrun(self, requests: Sequence[Submitted], now_ns: int) -> None:
        """Requests that ended without running (timed out in the queue, or shut down)."""
        with self._lock:
            for request in requests:
                for submitted in request.arrivals:
                    self.fail_count += 1
                    self.fail_ns += now_ns - submitted

    def fed_outcomes(self, counters: Callable[[], dict[str, int]]) -> None:
        """Add a feed's own counts to every snapshot: requests refused (429) and ended unrun (past their deadline
        or withdrawn while queued) before they reached a batch (native.py)."""
        self._fed = counters

    def batch(self, batch: Sequence[Submitted], rows: int, start: int, infer: int, output: int, end: int,
              ok: Sequence[bool]) -> None:
        input_ns, infer_ns, output_ns = infer - start, output - infer, end - output
        compute_s = (end - start) / 1e9
        compute_bucket = bisect.bisect_left(LATENCY_BUCKETS, compute_s)
        with self._lock:
            self.execution_count += 1
            self.inference_count += rows
            self.last_inference_ms = int(time.time() * 1000)
            per_size = self.batches.get(rows)
            if per_size is None:
                per_size = self.batches[rows] = [0, 0, 0, 0]
            per_size[0] += 1
            per_size[1] += input_ns
            per_size[2] += infer_ns
            per_size[3] += output_ns
            arrivals = [submitted for item in batch for submitted in item.arrivals]
            count = len(arrivals)
            self.compute_count += count
            self.compute_input_ns += input_ns * count
            self.compute_infer_ns += infer_ns * count
            self.compute_output_ns += output_ns * count
            self.compute_histogram[compute_bucket] += count
            for item, succeeded in zip(batch, ok, strict=True):
                for submitted in item.arrivals:
                    waited = start - submitted
                    self.queue_count += 1
                    self.queue_ns += waited
                    self.queue_histogram[bisect.bisect_left(LATENCY_BUCKETS, waited / 1e9)] += 1
                    if succeeded:
                        self.success_count += 1
                        self.success_ns += end - submitted
                    else:
                        self.fail_count += 1
                        self.fail_ns += end - submitted

    def snapshot(self) -> dict[str, Any]:
        fed = self._fed() if self._fed is not None else None
        with self._lock:
            state = {k: v for k, v in vars(self).items() if not k.startswith("_")}
            if fed is not None:
                state["rejected_count"] += fed["rejected"]
                state["fail_count"] += fed["expired"] + fed["aborted"]
                state["fail_ns"] += fed["expired_ns"] + fed["aborted_ns"]
            state["batches"] = {size: list(values) for size, values in self.batches.items()}
            state["queue_histogram"] = list(self.queue_histogram)
            state["compute_histogram"] = list(self.compute_histogram)
        return state



def merge_snapshots(snapshots: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several InferenceStats snapshots (of the server processes of one pod) as one: counts, times and histograms
    summed, per batch size too; the latest inference is the latest of all."""
    first, *others = snapshots
    merged = {**first, "batches": {size: list(values) for size, values in first["batches"].items()}}
    for snapshot in others:
        for key, value in snapshot.items():
            if key == "batches":
                for size, values in value.items():
                    merged["batches"][size] = _added(merged["batches"].get(size, [0] * len(values)), values)
            elif key == "last_inference_ms":
                merged[key] = max(merged[key], value)
            elif isinstance(value, list):
                merged[key] = _added(merged[key], value)
            else:
                merged[key] += value
    return merged


def _added(a: list[int], b: list[int]) -> list[int]:
    return [x + y for x, y in zip(a, b, strict=True)]
