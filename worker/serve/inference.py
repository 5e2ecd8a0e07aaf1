"""ParallelInference: DL4J's batched, multi-replica inference for PyTorch models.

    with ParallelInference(model, mode="batched", workers=2, batch_limit=32, queue_limit=64) as inference:
        y = inference.output(x)          # thread-safe; x has a batch dimension; y == model(x)

Modes (DL4J's InferenceMode):

- ``batched``: requests wait in one queue; a free worker takes the oldest one together with every queued
  request of the same per-example shape and dtype, up to ``batch_limit`` examples (optionally waiting up to
  ``max_delay_us`` for the batch to fill), runs one forward on its replica and splits the output back.
- ``sequential``: the same queue and workers, one request per forward, first in first out.
- ``inplace``: the caller's thread runs the forward on a free replica (no queue, no worker threads).

Each worker is one thread with its own replica (a deep copy of the model: on GPUs one per device, on CPU N
copies); torch releases the GIL during a forward, so replicas run in parallel. There is no thread per request
and no copy of the model per request. A full queue is rejected at once with QueueFullError; a request may
carry a timeout; ``update_model`` switches every replica atomically (requests already running finish on the
old model, none fails); ``shutdown`` finishes what is queued and stops the workers.
"""

from __future__ import annotations

import bisect
import copy
import logging
import threading
import time
from _thread import allocate_lock
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

log = logging.getLogger(__name__)

Mode = Literal["batched", "sequential", "inplace"]
MODES = ("batched", "sequential", "inplace")
Callback = Callable[[torch.Tensor | None, BaseException | None], None]

# Request latency buckets (seconds) for the queue and compute histograms.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)


class InferenceError(RuntimeError):
    """Base class of the errors ParallelInference raises for a request."""


class QueueFullError(InferenceError):
    """The queue already holds queue_limit requests: rejected at once, retry later (HTTP 429)."""


class InferenceTimeout(InferenceError, TimeoutError):
    """The request's timeout passed before its output was ready."""


class ModelError(InferenceError):
    """The model's forward raised, or returned something other than one tensor with a row per example."""


class ShutDownError(InferenceError):
    """ParallelInference has been shut down (or is shutting down without draining)."""


class InferenceStats:
    """Counters and histograms, updated once per batch under one lock; `snapshot()` reads them consistently.

    Names follow Triton's statistics: a request succeeds or fails; `inference_count` counts examples,
    `execution_count` forwards; queue and compute times are per request (each request in a batch is charged
    the batch's compute time), and `batches` holds, per batch size (examples), how many forwards ran and
    their input/infer/output time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
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

    def failed_unrun(self, requests: Sequence[_Request], now_ns: int) -> None:
        """Requests that ended without running (timed out in the queue, or shut down)."""
        with self._lock:
            for request in requests:
                self.fail_count += 1
                self.fail_ns += now_ns - request.submitted

    def batch(self, batch: Sequence[_Request], rows: int, start: int, infer: int, output: int, end: int,
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
            count = len(batch)
            self.compute_count += count
            self.compute_input_ns += input_ns * count
            self.compute_infer_ns += infer_ns * count
            self.compute_output_ns += output_ns * count
            self.compute_histogram[compute_bucket] += count
            for request, succeeded in zip(batch, ok, strict=True):
                waited = start - request.submitted
                self.queue_count += 1
                self.queue_ns += waited
                self.queue_histogram[bisect.bisect_left(LATENCY_BUCKETS, waited / 1e9)] += 1
                if succeeded:
                    self.success_count += 1
                    self.success_ns += end - request.submitted
                else:
                    self.fail_count += 1
                    self.fail_ns += end - request.submitted

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            state = {k: v for k, v in vars(self).items() if not k.startswith("_")}
            state["batches"] = {size: list(values) for size, values in self.batches.items()}
            state["queue_histogram"] = list(self.queue_histogram)
            state["compute_histogram"] = list(self.compute_histogram)
        return state


class _Request:
    """One call: its input, where its answer goes, and its timing."""

    __slots__ = ("x", "rows", "key", "submitted", "deadline", "callback", "done", "output", "error", "owner")

    def __init__(self, x: torch.Tensor | np.ndarray, callback: Callback | None, deadline: float | None,
                 owner: ParallelInference):
        self.x = x
        self.rows = x.shape[0]
        self.key = (x.shape[1:], x.dtype)
        self.submitted = time.perf_counter_ns()
        self.deadline = deadline  # time.monotonic() seconds, or None
        self.callback = callback
        self.done = None
        self.output: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.owner = owner

    def finish(self, output: torch.Tensor | None, error: BaseException | None) -> None:
        self.x = None  # let the input go as soon as it is answered
        self.output, self.error = output, error
        if self.callback is not None:
            try:
                self.callback(output, error)
            except Exception:  # a caller's callback must not take down a worker
                log.exception("inference callback failed")
        else:
            self.done.release()

    def cancel(self) -> bool:
        """Withdraw the request if it is still queued (its callback will then never run); False once running."""
        return self.owner._withdraw(self)


def _as_input(x: Any) -> torch.Tensor | np.ndarray:
    """A tensor, or a numpy array kept as one: numpy inputs are batched and turned into tensors on the worker
    thread (torch calls release the GIL, which on the caller's thread, an event loop say, costs a thread switch)
    and their outputs come back as numpy arrays."""
    if not isinstance(x, torch.Tensor | np.ndarray):
        x = torch.as_tensor(x)
    if x.ndim == 0 or x.shape[0] == 0:
        raise ValueError(f"input needs a batch dimension with at least one example; got shape {tuple(x.shape)}")
    return x


def default_devices(workers: int) -> list[torch.device]:
    """One replica per CUDA device (round robin when workers exceed devices), else all on the CPU."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return [torch.device("cuda", i % count) for i in range(workers)]
    return [torch.device("cpu")] * workers


def warmup_sizes(mode: str, batch_limit: int, example_rows: int = 1) -> list[int]:
    """Batch sizes a mode will run: batched mode any of 1..batch_limit (warmed at powers of two and the limit);
    sequential and inplace the sizes callers send."""
    if mode != "batched":
        return sorted({1, example_rows})
    sizes = {batch_limit}
    size = 1
    while size < batch_limit:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


class ParallelInference:
    """Thread-safe batched inference over `workers` replicas of `model` (see the module docstring).

    model: a torch.nn.Module mapping a batch (examples first) to one tensor with a row per example.
    mode: "batched" (default), "sequential" or "inplace".
    workers: model replicas and worker threads; default one per CUDA device, or 1 on CPU.
    batch_limit: most examples in one forward (batched mode); a single larger request runs alone.
    queue_limit: most requests waiting; one more raises QueueFullError at once.
    max_delay_us: how long a batch may wait for more requests once a worker is free (0: take what is queued).
    example: an input (with a batch dimension) to warm every replica up with, at every batch size in use,
        before serving and before update_model switches; also checks that the model runs at all.
    devices: one torch device per worker (default: CUDA devices round robin, else CPU).
    """

    def __init__(self, model: torch.nn.Module, mode: Mode = "batched", workers: int | None = None,
                 batch_limit: int = 32, queue_limit: int = 64, max_delay_us: int = 0,
                 example: Any = None, devices: Sequence[str | torch.device] | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if workers is None:
            workers = len(devices) if devices else max(1, torch.cuda.device_count())
        for name, value, least in (("workers", workers, 1), ("batch_limit", batch_limit, 1),
                                   ("queue_limit", queue_limit, 1), ("max_delay_us", max_delay_us, 0)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}; got {value!r}")
        self.mode = mode
        self.workers = workers
        self.batch_limit = batch_limit
        self.queue_limit = queue_limit
        self.max_delay_s = max_delay_us / 1e6
        self.devices = [torch.device(d) for d in devices] if devices else default_devices(workers)
        if len(self.devices) != workers:
            raise ValueError(f"devices lists {len(self.devices)} devices for {workers} workers")
        self.stats = InferenceStats()
        self._example = None if example is None else torch.as_tensor(_as_input(example))
        # Submitters append to the queue under _submit_lock (never contended by workers); workers take batches
        # under _cond, and a submitter takes _cond only to wake a worker that waits for work.
        self._submit_lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Request] = deque()
        self._idle_workers = 0
        self._running = 0
        self._closed = False
        self._free: list[int] = []  # inplace mode: indices of idle replicas
        self._waiting = 0  # inplace mode: callers waiting for a replica
        self._swap_lock = threading.Lock()
        self._replicas = self._build_replicas(model)
        self._generation = 0
        self._threads: list[threading.Thread] = []
        if mode == "inplace":
            self._free = list(range(workers))
        else:
            for index in range(workers):
                thread = threading.Thread(target=self._work, args=(index,), name=f"tandem-inference-{index}",
                                          daemon=True)
                thread.start()
                self._threads.append(thread)

    # -- the public API ---------------------------------------------------------------------------------

    def output(self, x: Any, timeout: float | None = None) -> Any:
        """model(x) for a batch `x` (a tensor, numpy array or nested list; examples first), computed on a
        replica, batched with other callers' requests in batched mode. Returns a tensor (a numpy array when
        `x` is one and numpy has the output's dtype). Raises QueueFullError when the queue is full,
        InferenceTimeout after `timeout` seconds, ModelError when the forward fails."""
        tensor = _as_input(x)
        if self.mode == "inplace":
            result = self._run_inplace(tensor, None, timeout)
        else:
            deadline = None if timeout is None else time.monotonic() + timeout
            request = _Request(tensor, None, deadline, self)
            request.done = allocate_lock()
            request.done.acquire()
            self._enqueue(request)
            if not request.done.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
                request.cancel()
                raise InferenceTimeout(f"no output within the request's timeout of {timeout * 1000:.0f} ms")
            if request.error is not None:
                raise request.error
            result = request.output
        return result

    def submit(self, x: Any, callback: Callback, timeout: float | None = None) -> _Request:
        """Low-level, for servers: queue `x` and return at once; `callback(output, error)` runs exactly once on
        the worker thread that answers it (in inplace mode, before submit returns). QueueFullError and
        ShutDownError are raised here, not passed to the callback. The returned handle's cancel() withdraws a
        request that is still queued. As with output(), numpy in gives numpy out."""
        tensor = _as_input(x)
        if self.mode == "inplace":
            request = _Request(tensor, callback, None, self)
            self._run_inplace(tensor, request, timeout)
            return request
        request = _Request(tensor, callback, None if timeout is None else time.monotonic() + timeout, self)
        self._enqueue(request)
        return request

    def update_model(self, model: torch.nn.Module) -> None:
        """Serve `model` from now on: new replicas are built (and warmed up with `example`) while the old ones
        keep serving, then all workers switch at once. Requests already running finish on the old model;
        queued ones run on the new one; none fails. If building or warming up the new model raises, the old
        model keeps serving and the error propagates."""
        with self._swap_lock:
            replicas = self._build_replicas(model)
            with self._cond:
                self._replicas = replicas
                self._generation += 1
                if self.mode == "inplace":
                    self._free = list(range(self.workers))
                    self._cond.notify_all()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; finish the queued ones (drain=True) or fail them with ShutDownError; stop
        the workers (waiting up to `timeout` seconds for them)."""
        with self._submit_lock, self._cond:
            self._closed = True
            dropped = [] if drain else list(self._queue)
            if dropped:
                self._queue.clear()
            self._cond.notify_all()
        if dropped:
            self.stats.failed_unrun(dropped, time.perf_counter_ns())
            for request in dropped:
                request.finish(None, ShutDownError("ParallelInference shut down before this request ran"))
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> ParallelInference:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    @property
    def queued(self) -> int:
        """Requests waiting for a worker."""
        return len(self._queue) + self._waiting

    @property
    def pending(self) -> int:
        """Requests queued or running."""
        return len(self._queue) + self._waiting + self._running

    @property
    def closed(self) -> bool:
        return self._closed

    # -- replicas -----------------------------------------------------------------------------------------

    def _build_replicas(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        replicas = []
        for device in self.devices:
            replica = copy.deepcopy(model).to(device).eval()
            replica.requires_grad_(False)
            replicas.append(replica)
        if self._example is not None:
            self._warm_up(replicas)
        return replicas

    def _warm_up(self, replicas: list[torch.nn.Module]) -> None:
        one = self._example[:1]
        for size in warmup_sizes(self.mode, self.batch_limit, self._example.shape[0]):
            batch = one.expand(size, *one.shape[1:]).contiguous()
            for replica, device in zip(replicas, self.devices, strict=True):
                _forward(replica, batch.to(device), size)

    # -- queue and workers ----------------------------------------------------------------------------------

    def _enqueue(self, request: _Request) -> None:
        with self._submit_lock:
            if self._closed:
                raise ShutDownError("ParallelInference is shut down")
            if len(self._queue) >= self.queue_limit:
                self.stats.rejected()
                raise QueueFullError(
                    f"queue full: {self.queue_limit} requests already waiting (queue_limit={self.queue_limit}); "
                    "retry later")
            self._queue.append(request)
        if self._idle_workers:  # read after the append; a worker counts itself before it looks at the queue
            with self._cond:
                self._cond.notify()

    def _withdraw(self, request: _Request) -> bool:
        with self._cond:
            try:
                self._queue.remove(request)
            except ValueError:
                return False
        self.stats.failed_unrun([request], time.perf_counter_ns())
        return True

    def _work(self, index: int) -> None:
        while True:
            batch, expired = self._take(index)
            if expired:
                self._expire(expired)
            if batch is None:
                return
            if batch:
                replica = self._replicas[index]
                try:
                    self._run(replica, self.devices[index], batch)
                finally:
                    with self._cond:
                        self._running -= len(batch)

    def _take(self, index: int) -> tuple[list[_Request] | None, list[_Request]]:
        """The next batch for worker `index` (None: shut down and drained), and requests found expired."""
        with self._cond:
            self._idle_workers += 1  # before looking at the queue: a submitter that appends after this notifies
            try:
                while True:
                    queue = self._queue
                    if not queue:
                        if self._closed:
                            return None, []
                        self._cond.wait()
                        continue
                    if self.max_delay_s and self.mode == "batched" and not self._closed \
                            and sum(r.rows for r in queue) < self.batch_limit:
                        wait = queue[0].submitted / 1e9 + self.max_delay_s - time.perf_counter_ns() / 1e9
                        if wait > 0:
                            self._cond.wait(wait)
                            continue
                    batch, expired = self._pop_batch()
                    self._running += len(batch)
                    return batch, expired
            finally:
                self._idle_workers -= 1

    def _pop_batch(self) -> tuple[list[_Request], list[_Request]]:
        queue = self._queue
        now = time.monotonic()
        expired: list[_Request] = []
        batch: list[_Request] = []
        rows = 0
        limit = self.batch_limit if self.mode == "batched" else 1
        key = None
        kept: list[_Request] | None = None  # requests skipped over (other shape), to put back in order
        while queue:
            request = queue.popleft()
            if request.deadline is not None and now > request.deadline:
                expired.append(request)
                continue
            if key is None:
                key, rows = request.key, request.rows
                batch.append(request)
                if self.mode != "batched" or rows >= limit:
                    break
                continue
            if request.key == key and rows + request.rows <= limit:
                batch.append(request)
                rows += request.rows
                if rows >= limit:
                    break
                continue
            if kept is None:
                kept = []
            kept.append(request)
            if len(kept) >= self.queue_limit:  # scanned far enough
                break
        if kept:
            queue.extendleft(reversed(kept))
        return batch, expired

    def _expire(self, expired: list[_Request]) -> None:
        self.stats.failed_unrun(expired, time.perf_counter_ns())
        for request in expired:
            waited = (time.perf_counter_ns() - request.submitted) / 1e6
            request.finish(None, InferenceTimeout(f"timed out after waiting {waited:.0f} ms in the queue"))

    def _run(self, replica: torch.nn.Module, device: torch.device, batch: list[_Request]) -> None:
        """One forward for `batch`; a failing batch of several requests is retried one request at a time so
        that only the request that breaks the model fails."""
        start = time.perf_counter_ns()
        rows = sum(r.rows for r in batch) if len(batch) > 1 else batch[0].rows
        try:
            first = batch[0].x
            as_numpy = isinstance(first, np.ndarray)
            if as_numpy:
                x = first if len(batch) == 1 else np.concatenate([r.x for r in batch])
                x = torch.from_numpy(x if x.flags.writeable else x.copy())
            else:
                x = first if len(batch) == 1 else torch.cat([r.x for r in batch])
            if device.type != "cpu":
                x = x.to(device, non_blocking=True)
            infer = time.perf_counter_ns()
            out = _forward(replica, x, rows)
            output = time.perf_counter_ns()
            if out.device.type != "cpu":
                out = out.cpu()
            if as_numpy and out.dtype != torch.bfloat16:  # numpy has no bfloat16: those stay tensors
                out = out.numpy()
            pieces = [out] if len(batch) == 1 else _split(out, batch)
        except Exception as error:
            if len(batch) > 1:
                for request in batch:
                    self._run(replica, device, [request])
                return
            end = time.perf_counter_ns()
            self.stats.batch(batch, rows, start, end, end, end, (False,))
            batch[0].finish(None, error if isinstance(error, ModelError) else _model_error(error))
            return
        end = time.perf_counter_ns()
        self.stats.batch(batch, rows, start, infer, output, end, (True,) * len(batch))
        for request, piece in zip(batch, pieces, strict=True):
            request.finish(piece, None)

    # -- inplace mode -----------------------------------------------------------------------------------------

    def _run_inplace(self, x: torch.Tensor, request: _Request | None, timeout: float | None) -> torch.Tensor:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise ShutDownError("ParallelInference is shut down")
                if self._free:
                    index = self._free.pop()
                    generation = self._generation
                    replica = self._replicas[index]
                    self._running += 1
                    break
                if self._waiting >= self.queue_limit:
                    self.stats.rejected()
                    raise QueueFullError(f"queue full: {self.queue_limit} callers already waiting for a replica "
                                         f"(queue_limit={self.queue_limit}); retry later")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise InferenceTimeout(f"no replica free within the request's timeout of {timeout * 1000:.0f} ms")
                self._waiting += 1
                try:
                    self._cond.wait(remaining)
                finally:
                    self._waiting -= 1
        own = request if request is not None else _Request(x, None, None, self)
        if request is None:
            own.done = allocate_lock()
            own.done.acquire()
        try:
            self._run(replica, self.devices[index], [own])
        finally:
            with self._cond:
                self._running -= 1
                if generation == self._generation:
                    self._free.append(index)
                    self._cond.notify()
        if request is None:
            if own.error is not None:
                raise own.error
            return own.output
        return None


def _split(out: torch.Tensor | np.ndarray, batch: list[_Request]) -> list[torch.Tensor | np.ndarray]:
    if isinstance(out, torch.Tensor):
        return list(out.split([r.rows for r in batch]))
    pieces, offset = [], 0
    for request in batch:
        pieces.append(out[offset:offset + request.rows])
        offset += request.rows
    return pieces


def _forward(replica: torch.nn.Module, x: torch.Tensor, rows: int) -> torch.Tensor:
    with torch.no_grad():
        out = replica(x)
    if not isinstance(out, torch.Tensor):
        raise ModelError(f"the model returned a {type(out).__name__}; ParallelInference serves models that return "
                         "one tensor")
    if out.dim() == 0 or out.shape[0] != rows:
        raise ModelError(f"the model returned shape {tuple(out.shape)} for a batch of {rows}; the output needs one "
                         "row per example")
    return out


def _model_error(error: Exception) -> ModelError:
    wrapped = ModelError(f"the model's forward failed: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped
