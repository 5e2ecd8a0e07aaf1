"""How ParallelInference's requests become batches: a Ticket per call (its input, where its answer goes, its
timing), how long a free worker waits for a fuller batch, joining the batch's inputs into one and splitting the
output back into each request's rows. Taking a batch from the queues is feeds.py's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from tandem.worker.serve.inference import ParallelInference

log = logging.getLogger("tandem.worker.serve.inference")

Callback = Callable[[torch.Tensor | None, BaseException | None], None]


class Ticket:
    """One call: its input, where its answer goes (a callback, or a lock its caller waits on), and its timing.
    ParallelInference.submit returns it; `cancel()` withdraws it while it is still queued."""

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
        return self.owner.withdraw(self)

    def split(self) -> list[Ticket]:
        """Its requests one by one (a failed forward's retry): itself."""
        return [self]

    @property
    def arrivals(self) -> tuple[int]:
        """When its request was submitted (the statistics' view of a batch's item: stats.Submitted)."""
        return (self.submitted,)


def as_input(x: Any) -> torch.Tensor | np.ndarray:
    """A tensor, or a numpy array kept as one: numpy inputs are batched and turned into tensors on the worker
    thread (torch calls release the GIL, which on the caller's thread, an event loop say, costs a thread switch)
    and their outputs come back as numpy arrays."""
    if not isinstance(x, torch.Tensor | np.ndarray):
        x = torch.as_tensor(x)
    if x.ndim == 0 or x.shape[0] == 0:
        raise ValueError(f"input needs a batch dimension with at least one example; got shape {tuple(x.shape)}")
    return x


def fuller_batch_wait(queued_rows: int, batch_limit: int, running_rows: int, shared_device: bool, oldest_waited_ns: int,
                      idle_ns: int, last_forward_ns: int, last_rows: int) -> int:
    """How long (ns) a free worker waits for a fuller batch before it takes what is queued (0: take it now), never
    once the queue holds a full batch, and at most as long as the last forward took (so a slow or stuck forward holds
    nothing back for longer): counted from the oldest request's arrival where replicas share the device, from the
    end of the worker's last forward (`idle_ns` ago) where it is alone.

    Where replicas share the device and another replica runs a forward there: while the examples queued and
    running together make at least a full batch (the cores are busy: a full batch will form). Two partial forwards
    side by side on the same cores each cost more per example than one fuller forward after the other (measured in
    bench/RESULTS.md); under lighter load the partial forwards run side by side, each on a core that would otherwise
    idle.

    A worker alone on its device (one replica, or one per GPU), or sharing it with replicas none of which runs a
    forward: while fewer examples are queued than the last forward took (`last_rows`). The clients answered by that
    forward are likely to send again (a closed loop, each client waiting for its answer), and a forward of the first
    few of them streams the weights once for little: a server process of one replica under 64 connections ran 116
    forwards of 1 example and 190 of 4 in 8 s beside its full ones. Under steady open load the queue already holds
    as many as the last forward when it ends (they arrived during it), so nothing waits; where the load falls, one
    forward waits, and the next expects fewer. (Replicas sharing the cores that took what was queued as soon as none
    ran split the clients of two full batches into short ones, and kept splitting them: one process of two workers
    under 64 connections ran 94% of its examples in full batches and answered 0.63 of the raw forward;
    bench/RESULTS.md, twelfth pass.)"""
    shared = shared_device and running_rows > 0
    if queued_rows >= fill_target(batch_limit, shared, last_rows):
        return 0
    if shared:
        if queued_rows + running_rows < batch_limit:
            return 0
        return max(0, last_forward_ns - oldest_waited_ns)
    # Not since the oldest arrived: requests left over from a capped batch arrived during the last forward, and
    # would otherwise go at once as a small forward of their own (a forward of 32, then one of the 4 left, ...).
    return max(0, last_forward_ns - idle_ns)


def fill_target(batch_limit: int, shared: bool, last_rows: int) -> int:
    """The examples a worker waiting for a fuller batch waits for (fuller_batch_wait): a full batch where another
    replica runs a forward on its device (`shared`); as many as the last forward had, up to a full batch,
    otherwise."""
    return batch_limit if shared else min(batch_limit, last_rows)


def join_inputs(batch: list[Ticket]) -> tuple[torch.Tensor, bool]:
    """The batch's inputs as one tensor (on the CPU), and whether they came as numpy arrays (then the outputs go
    back as numpy arrays too)."""
    first = batch[0].x
    as_numpy = isinstance(first, np.ndarray)
    if as_numpy:
        x = first if len(batch) == 1 else np.concatenate([r.x for r in batch])
        return torch.from_numpy(x if x.flags.writeable else x.copy()), True
    return (first if len(batch) == 1 else torch.cat([r.x for r in batch])), False


def split_output(out: torch.Tensor | np.ndarray, batch: list[Ticket]) -> list[torch.Tensor | np.ndarray]:
    """Each request's rows of the batch's output."""
    if len(batch) == 1:
        return [out]
    if isinstance(out, torch.Tensor):
        return list(out.split([r.rows for r in batch]))
    pieces, offset = [], 0
    for request in batch:
        pieces.append(out[offset:offset + request.rows])
        offset += request.rows
    return pieces
