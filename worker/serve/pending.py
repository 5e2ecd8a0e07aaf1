"""Inference requests between submit and answer, and their deadlines.

A `Pending` request is answered exactly once: by its output (delivered from ParallelInference's worker threads
to the event loop in bursts, one wake-up per burst), by its deadline passing (504), by the server stopping
(503), or never, when its client goes away. `PendingRequests` counts them, sweeps their deadlines every
TIMEOUT_SWEEP_S instead of a timer per request (a timer each cost about 13% of throughput), and lets a drain
wait until every one is answered. How an answer is written is the caller's: `answer(request, context, output,
error)`, on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from tandem.worker.serve.errors import InferenceTimeout, ShutDownError
from tandem.worker.serve.tasks import cancel_and_wait

log = logging.getLogger("tandem.serve")

TIMEOUT_SWEEP_S = 0.02

Answer = Callable[[Any, Any, Any, BaseException | None], None]
"""answer(request, context, output, error): write the answer of one request (error None: `output` is its output)."""


class Completions:
    """Hands results from worker threads to the event loop: one wake-up per burst of results, not per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Any, Any, BaseException | None]] = []

    def post(self, done, output: Any, error: BaseException | None) -> None:
        """Call `done(output, error)` on the event loop's thread."""
        with self._lock:
            self._items.append((done, output, error))
            if len(self._items) > 1:
                return  # a delivery is already scheduled and will take this one too
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for done, output, error in items:
            try:
                done(output, error)
            except Exception:
                log.exception("answering an inference request failed")


class Pending:
    """One request between submit and answer. `ticket` is ParallelInference's handle (to withdraw it while it is
    queued); `context` is the caller's, handed back to `answer` with the request."""

    __slots__ = ("owner", "request", "context", "ticket", "deadline", "timeout", "pools", "finished")

    def __init__(self, owner: PendingRequests, request: Any, context: Any, timeout: float, deadline: float):
        self.owner = owner
        self.request = request
        self.context = context
        self.timeout = timeout
        self.pools = timeout == owner.default_timeout  # the pool's timeout, not the request's own (even once changed)
        self.deadline = deadline
        self.ticket = None
        self.finished = False

    def post(self, output: Any, error: BaseException | None) -> None:
        """ParallelInference's callback, on a worker thread: answer on the event loop."""
        self.owner._completions.post(self.done, output, error)

    def done(self, output: Any, error: BaseException | None) -> None:
        if self.finished:
            return
        request, context = self.request, self.context
        self._finish()
        self.owner._answer(request, context, output, error)

    def expire(self) -> None:
        """Past the deadline (the timeout sweep): answer 504 unless answered already."""
        if not self.finished:
            self.ticket.cancel()
            milliseconds = f"{self.timeout * 1000:.0f} ms"
            if self.pools:
                why = f"the pool's requestTimeoutMs of {milliseconds}"
            else:
                why = f"the request's timeout of {milliseconds} (parameters.timeout)"
            self.done(None, InferenceTimeout(f"no output within {why}"))

    def cut_off(self, why: str) -> None:
        """The server stops: answer 503 unless answered already (a forward still running is left to finish)."""
        if not self.finished:
            self.ticket.cancel()
            self.done(None, ShutDownError(f"the server stopped before this request was answered ({why})"))

    def abort(self) -> None:
        """The client went away: withdraw the request if it is still queued."""
        if not self.finished:
            self._finish()
            self.ticket.cancel()

    def _finish(self) -> None:
        self.finished = True
        self.request = self.context = None  # it may wait in the timeout sweep's queue a while: keep it light
        self.owner._finished()


class PendingRequests:
    """The requests submitted and not answered yet, on one event loop (`start` it there first).

    Use: `pending = requests.new(request, context, timeout)`, submit with `pending.post` as the callback and
    keep the handle in `pending.ticket`, then `requests.track(pending)`; the request's `on_abort` is set to
    withdraw it when its client goes away."""

    def __init__(self, answer: Answer, default_timeout: float):
        self.default_timeout = default_timeout
        self._answer = answer
        self._count = 0
        self._completions: Completions | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._answered: asyncio.Event | None = None  # set when the count reaches 0 while a drain waits
        self._sweeper: asyncio.Task | None = None
        # By deadline: requests with the default timeout arrive in deadline order (a deque); shorter per-request
        # timeouts go to a heap.
        self._deadlines: deque[Pending] = deque()
        self._early: list[tuple[float, int, Pending]] = []
        self._early_count = 0

    @property
    def count(self) -> int:
        """Requests submitted and not answered yet."""
        return self._count

    def start(self) -> None:
        """Begin on the running event loop: answers are delivered to it and deadlines swept on it."""
        self._loop = asyncio.get_running_loop()
        self._completions = Completions(self._loop)
        self._sweeper = asyncio.create_task(self._sweep())

    def set_default_timeout(self, timeout: float) -> None:
        """Requests submitted from now on get `timeout`; those pending keep theirs. (Their deadlines move to the
        heap: the deque holds default deadlines in order, which requests with the new timeout would break.)"""
        for pending in self._deadlines:
            if not pending.finished:
                self._early_count += 1
                heapq.heappush(self._early, (pending.deadline, self._early_count, pending))
        self._deadlines.clear()
        self.default_timeout = timeout

    def new(self, request: Any, context: Any, timeout: float) -> Pending:
        """A request due in `timeout` seconds from now, not tracked until `track` (once it is submitted)."""
        return Pending(self, request, context, timeout, self._loop.time() + timeout)

    def track(self, pending: Pending) -> None:
        """Count a submitted request and watch its deadline."""
        self._count += 1
        if pending.pools and pending.timeout == self.default_timeout:
            self._deadlines.append(pending)
        else:
            self._early_count += 1
            heapq.heappush(self._early, (pending.deadline, self._early_count, pending))
        pending.request.on_abort = pending.abort

    async def wait_answered(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until every request is answered; True if they all were."""
        if not self._count:
            return True
        self._answered = asyncio.Event()
        try:
            await asyncio.wait_for(self._answered.wait(), timeout)
        except TimeoutError:
            return False
        finally:
            self._answered = None
        return True

    async def stop_sweep(self) -> None:
        sweeper, self._sweeper = self._sweeper, None
        await cancel_and_wait(sweeper)

    def cut_off(self, why: str) -> None:
        """Answer every request not answered yet with 503 (`why` says why), now."""
        unanswered = [*self._deadlines, *(entry[2] for entry in self._early)]
        self._deadlines.clear()
        self._early.clear()
        for pending in unanswered:
            pending.cut_off(why)

    def _finished(self) -> None:
        self._count -= 1
        if self._count == 0 and self._answered is not None:
            self._answered.set()

    async def _sweep(self) -> None:
        loop = self._loop
        deadlines, early = self._deadlines, self._early
        while True:
            await asyncio.sleep(TIMEOUT_SWEEP_S)
            now = loop.time()
            try:
                while deadlines and (deadlines[0].finished or deadlines[0].deadline <= now):
                    deadlines.popleft().expire()
                while early and (early[0][2].finished or early[0][0] <= now):
                    heapq.heappop(early)[2].expire()
            except Exception:  # never let one bad answer stop the sweep
                log.exception("expiring a timed-out request failed")
