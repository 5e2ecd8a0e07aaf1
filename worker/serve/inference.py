"""ParallelInference: DL4J's batched, multi-replica inference for PyTorch models.

    with ParallelInference(model, mode="batched", workers=2, batch_limit=32, queue_limit=64) as inference:
        y = inference.output(x)          # thread-safe; x has a batch dimension; y == model(x)

Modes (DL4J's InferenceMode):

- ``batched``: requests wait in one queue; a free worker takes the oldest one together with every queued
  request of the same per-example shape and dtype, up to ``batch_limit`` examples (optionally waiting up to
  ``max_delay_us`` for the batch to fill), runs one forward on its replica and splits the output back. Where
  the replicas share one device (on CPU: the cores) and the examples queued and running make at least a full
  batch, a free worker beside a running forward waits until the queue holds a full batch, that forward ends, or
  the oldest request has waited as long as the last forward took; under lighter load it takes what is queued. A
  worker alone on its device waits, at most as long as its last forward took, for as many examples as that forward
  had (the clients just answered are likely to send again).
- ``sequential``: the same queue and workers, one request per forward, first in first out.
- ``inplace``: the caller's thread runs the forward on a free replica (no queue, no worker threads).

Each worker is one thread; the workers on one device share one frozen copy of the model (one per GPU, one on the CPU
however many workers run there): torch releases the GIL during a forward, so they run in parallel. There is no
thread per request and no copy of the model per request. A full queue is rejected at once with QueueFullError; a
request may carry a timeout; ``update_model`` switches every replica atomically (requests already running finish on
the old model, none fails); ``update`` changes batch_limit, queue_limit and max_delay_us while serving (none fails
either); ``shutdown`` finishes what is queued and stops the workers.

This module is the engine: the worker threads, the modes, swapping and shutting down. Beside it: feeds.py (the
queues the workers take batches from: its own, and an attached front's), batching.py (a request's Ticket, waiting
for a fuller batch, joining inputs and splitting outputs), replicas.py (copies of
the model, warm-up, a checked forward, a batch run and answered), errors.py (the InferenceErrors, importable from
here too) and stats.py (``stats``: requests, examples, forwards and their times).
"""

from __future__ import annotations

import threading
import time
from _thread import allocate_lock
from collections.abc import Sequence
from typing import Any, Literal

import torch

from tandem.worker.serve.batching import Callback, Ticket, as_input, fill_target, fuller_batch_wait
from tandem.worker.serve.errors import (
    InferenceError,
    InferenceTimeout,
    ModelError,
    QueueFullError,
    ShutDownError,
    queue_full_message,
)
from tandem.worker.serve.feeds import Feed, State, TicketQueue, take_batch, tell_others, want_rows
from tandem.worker.serve.replicas import build_replicas, default_devices, run_batch, warmup_sizes
from tandem.worker.serve.stats import InferenceStats

Mode = Literal["batched", "sequential", "inplace"]
MODES = ("batched", "sequential", "inplace")
__all__ = ["MODES", "InferenceError", "InferenceTimeout", "Mode", "ModelError", "ParallelInference", "QueueFullError",
           "ShutDownError"]


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
        _check_limits(workers=workers, batch_limit=batch_limit, queue_limit=queue_limit, max_delay_us=max_delay_us)
        self.mode = mode
        self.workers = workers
        self.batch_limit = batch_limit
        self.queue_limit = queue_limit
        self.max_delay_s = max_delay_us / 1e6
        self.devices = [torch.device(d) for d in devices] if devices else default_devices(workers)
        if len(self.devices) != workers:
            raise ValueError(f"devices lists {len(self.devices)} devices for {workers} workers")
        self._shared_device = workers > 1 and len(set(self.devices)) == 1
        self.stats = InferenceStats()
        self._example = None if example is None else torch.as_tensor(as_input(example))
        # Submitters queue under _submit_lock (never contended by workers); workers take batches under _cond, and a
        # submitter takes _cond only to wake the workers when it brings a feed to what they want (_wait).
        self._submit_lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._queue = TicketQueue()
        self._feeds: list[Feed] = [self._queue]  # its own queue first, attached ones after
        self._filling_workers = 0  # waiting for a fuller batch (a forward's end wakes them)
        self._forward_ns = 0  # how long the last forward took
        self._last_rows = 0  # and how many examples it had
        self._forward_end_ns = 0  # and when it ended
        self._running = 0
        self._running_rows = 0  # examples in the forwards running (batched mode)
        self._closed = False
        self._free: list[int] = []  # inplace mode: indices of idle replicas
        self._waiting = 0  # inplace mode: callers waiting for a replica
        self._swap_lock = threading.Lock()
        self._torch_threads = torch.get_num_threads()
        self._replicas = self._build_replicas(model, batch_limit)
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
        tensor = as_input(x)
        if self.mode == "inplace":
            result = self._run_inplace(tensor, None, timeout)
        else:
            deadline = None if timeout is None else time.monotonic() + timeout
            request = Ticket(tensor, None, deadline, self)
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

    def submit(self, x: Any, callback: Callback, timeout: float | None = None) -> Ticket:
        """Low-level, for servers: queue `x` and return at once; `callback(output, error)` runs exactly once on
        the worker thread that answers it (in inplace mode, before submit returns). QueueFullError and
        ShutDownError are raised here, not passed to the callback. The returned handle's cancel() withdraws a
        request that is still queued. As with output(), numpy in gives numpy out."""
        tensor = as_input(x)
        if self.mode == "inplace":
            request = Ticket(tensor, callback, None, self)
            self._run_inplace(tensor, request, timeout)
            return request
        request = Ticket(tensor, callback, None if timeout is None else time.monotonic() + timeout, self)
        self._enqueue(request)
        return request

    def update_model(self, model: torch.nn.Module) -> None:
        """Serve `model` from now on: new replicas are built (and warmed up with `example`) while the old ones
        keep serving, then all workers switch at once. Requests already running finish on the old model;
        queued ones run on the new one; none fails. If building or warming up the new model raises, the old
        model keeps serving and the error propagates."""
        with self._swap_lock:
            self.switch_to(self.prepare(model))

    def attach(self, feed: Feed) -> None:
        """Also take requests from `feed`, a queue kept outside the interpreter (native.py's front): its requests
        join the batches of the same shape, oldest first with this queue's own. Batched and sequential modes."""
        if self.mode == "inplace":
            raise ValueError("a feed needs a queue: inplace mode has none")
        with self._submit_lock, self._cond:
            self._feeds = [*self._feeds, feed]
            self._cond.notify_all()  # workers waiting for this queue's requests wait for the feed's too

    def wake(self) -> None:
        """Wake the workers waiting for requests: a feed's `want` is met."""
        with self._cond:
            self._cond.notify_all()

    @property
    def replicas(self) -> list[torch.nn.Module]:
        """The model replicas serving now, one per worker (workers on one device share one)."""
        return list(self._replicas)

    def prepare(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """`update_model`'s first half: `model`'s replicas, built and warmed up, for `switch_to` (the server
        processes of a pod prepare, then all switch)."""
        return self._build_replicas(model, self.batch_limit)

    def switch_to(self, replicas: list[torch.nn.Module]) -> None:
        """`update_model`'s second half: serve these prepared replicas from now on."""
        with self._cond:
            self._replicas = replicas
            self._generation += 1
            if self.mode == "inplace":
                self._free = list(range(self.workers))
                self._cond.notify_all()

    def update(self, batch_limit: int | None = None, queue_limit: int | None = None,
               max_delay_us: int | None = None) -> None:
        """Batch, queue and wait with new limits from now on (None: keep that one), all three at once. No request
        fails: running batches finish as they were taken, queued requests stay queued (even beyond a lowered
        queue_limit; only new ones are refused), and a batch_limit that brings batch sizes not warmed up yet is
        warmed up on new replicas first, while the old ones keep serving."""
        batch_limit = self.batch_limit if batch_limit is None else batch_limit
        queue_limit = self.queue_limit if queue_limit is None else queue_limit
        max_delay_us = round(self.max_delay_s * 1e6) if max_delay_us is None else max_delay_us
        _check_limits(batch_limit=batch_limit, queue_limit=queue_limit, max_delay_us=max_delay_us)
        with self._swap_lock:
            replicas = None
            if self._example is not None and not set(self._warmup_sizes(batch_limit)) <= set(
                    self._warmup_sizes(self.batch_limit)):
                replicas = self._build_replicas(self._replicas[0], batch_limit)
            with self._submit_lock, self._cond:
                if replicas is not None:
                    self._replicas = replicas
                    self._generation += 1
                    if self.mode == "inplace":
                        self._free = list(range(self.workers))
                self.batch_limit, self.queue_limit, self.max_delay_s = batch_limit, queue_limit, max_delay_us / 1e6
                self._cond.notify_all()  # workers waiting for a batch to fill wait by the new delay

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; finish the queued ones (drain=True) or fail them with ShutDownError; stop
        the workers (waiting up to `timeout` seconds for them)."""
        with self._submit_lock, self._cond:
            self._closed = True
            dropped = [] if drain else self._queue.clear()
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
        """Requests waiting for a worker (an attached feed's too)."""
        return self._waiting + sum(feed.queued()[1] for feed in self._feeds)

    @property
    def pending(self) -> int:
        """Requests queued or running."""
        return self.queued + self._running

    @property
    def closed(self) -> bool:
        return self._closed

    # -- replicas -----------------------------------------------------------------------------------------

    def _build_replicas(self, model: torch.nn.Module, batch_limit: int) -> list[torch.nn.Module]:
        return build_replicas(model, self.devices, self._example, self._warmup_sizes(batch_limit))

    def _warmup_sizes(self, batch_limit: int) -> list[int]:
        return [] if self._example is None else warmup_sizes(self.mode, batch_limit, self._example.shape[0])

    # -- queue and workers ----------------------------------------------------------------------------------

    def _enqueue(self, request: Ticket) -> None:
        with self._submit_lock:
            if self._closed:
                raise ShutDownError("ParallelInference is shut down")
            feeds = self._feeds
            held = [feed.queued()[1] for feed in feeds]
            if sum(held) >= self.queue_limit:
                self.stats.rejected()
                raise QueueFullError(queue_full_message(self.queue_limit))
            wanted = self._queue.put(request)
            held[0] += 1
            tell_others(feeds, held)
        if wanted:
            self.wake()

    def withdraw(self, request: Ticket) -> bool:
        """Take `request` out of the queue if it is still there (Ticket.cancel)."""
        with self._cond:
            if not self._queue.remove(request):
                return False
            tell_others(self._feeds, [feed.queued()[1] for feed in self._feeds])
        self.stats.failed_unrun([request], time.perf_counter_ns())
        return True

    def _work(self, index: int) -> None:
        # The thread count torch.set_num_threads gave the creating thread is that thread's own (OpenMP's setting is
        # per thread): without this, a worker's small matrix products ran on extra MKL threads too, more threads
        # than cores beside the other replicas (measured in bench/RESULTS.md).
        torch.set_num_threads(self._torch_threads)
        while True:
            batch, rows, expired = self._take()
            if expired:
                self._expire(expired)
            if batch is None:
                return
            if batch:
                replica = self._replicas[index]
                try:
                    self._run(replica, self.devices[index], batch, rows)
                finally:
                    with self._cond:
                        self._running -= len(batch)
                        self._running_rows -= rows
                        if self._filling_workers:
                            self._cond.notify_all()

    def _take(self) -> tuple[list[Any] | None, int, list[Ticket]]:
        """The next batch (None: shut down and drained), its examples, and requests found expired."""
        with self._cond:
            while True:
                # Shut down, the workers drain their own queue; an attached feed answers its own (NativeFront.stop).
                feeds = self._feeds[:1] if self._closed else self._feeds
                states = [feed.queued() for feed in feeds]
                rows = sum(state[0] for state in states)
                if not rows:
                    if self._closed:
                        return None, 0, []
                    self._wait(feeds, states, 1, None)
                    continue
                batched = self.mode == "batched"
                if batched and not self._closed and rows < self.batch_limit:
                    oldest = min(state[2] for state in states if state[1])
                    if self.max_delay_s:
                        wait = oldest / 1e9 + self.max_delay_s - time.perf_counter_ns() / 1e9
                        if wait > 0:
                            self._wait(feeds, states, self.batch_limit, wait)
                            continue
                    now = time.perf_counter_ns()
                    wait_ns = fuller_batch_wait(rows, self.batch_limit, self._running_rows, self._shared_device,
                                                now - oldest, now - self._forward_end_ns, self._forward_ns,
                                                self._last_rows)
                    if wait_ns:
                        target = fill_target(self.batch_limit, self._shared_device and self._running_rows > 0,
                                             self._last_rows)
                        self._filling_workers += 1  # a forward's end wakes it too
                        try:
                            self._wait(feeds, states, target, wait_ns / 1e9)
                        finally:
                            self._filling_workers -= 1
                        continue
                limit = self.batch_limit if batched else 1
                batch, rows, expired = take_batch(feeds, states, limit, limit)
                tell_others(feeds, [feed.queued()[1] for feed in feeds])
                self._running += len(batch)
                self._running_rows += rows
                return batch, rows, expired

    def _wait(self, feeds: list[Feed], states: list[State], target: int, timeout: float | None) -> None:
        """Wait (under _cond) until the feeds hold `target` examples (each feed's `want` wakes the workers), a
        notify, or `timeout`. A request queued since `states` was read is seen here and not waited for; one queued
        after this look meets the want."""
        want_rows(feeds, states, target)
        if [feed.queued() for feed in feeds] == states:
            self._cond.wait(timeout)

    def _expire(self, expired: list[Ticket]) -> None:
        self.stats.failed_unrun(expired, time.perf_counter_ns())
        for request in expired:
            waited = (time.perf_counter_ns() - request.submitted) / 1e6
            request.finish(None, InferenceTimeout(f"timed out after waiting {waited:.0f} ms in the queue"))

    def _run(self, replica: torch.nn.Module, device: torch.device, batch: list[Ticket], rows: int) -> None:
        forward_ns = run_batch(replica, device, batch, self.stats, rows)
        if forward_ns is not None:
            self._forward_ns = forward_ns
            self._last_rows = rows
            self._forward_end_ns = time.perf_counter_ns()

    # -- inplace mode -----------------------------------------------------------------------------------------

    def _run_inplace(self, x: torch.Tensor, request: Ticket | None, timeout: float | None) -> torch.Tensor:
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
        own = request if request is not None else Ticket(x, None, None, self)
        if request is None:
            own.done = allocate_lock()
            own.done.acquire()
        try:
            self._run(replica, self.devices[index], [own], own.rows)
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


def _check_limits(**limits: int) -> None:
    for name, value in limits.items():
        least = 0 if name == "max_delay_us" else 1
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}; got {value!r}")

