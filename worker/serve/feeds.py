"""Where ParallelInference's workers take their requests from: feeds, each a queue of requests behind one interface
(Feed). Its own queue of Tickets (submit's and output's) is one, TicketQueue; a front that queues requests outside the
interpreter (native.py's NativeFront) is another, attached after it. A worker takes the next batch from all of them
alike (take_batch), tells each feed what it waits for (want_rows) and how many requests the others hold (tell_others).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from tandem.worker.serve.batching import Ticket

State = tuple[int, int, int]
"""A feed's `queued()`: (examples, requests, the oldest's arrival in perf_counter ns or 0)."""


class Feed(Protocol):
    """Requests queued for ParallelInference's workers. A taken item is one item of a batch, with `x`, `rows`, `key`
    (the per-example shape and dtype), `submitted` (its oldest arrival), `arrivals` (one per request),
    `finish(output, error)` and `split()` as a Ticket has (a Ticket is one; native.py's Bundle holds several)."""

    def queued(self) -> State:
        """(examples, requests, the oldest's arrival in perf_counter ns or 0) queued now."""

    def take(self, max_rows: int, max_requests: int, key: Any) -> tuple[list[Any], list[Any]]:
        """The oldest queued requests of `key`, up to `max_rows` examples and `max_requests` requests, as batch
        items, and the requests found past their deadline on the way (answered InferenceTimeout by the worker).
        `key` None: the batch is empty; it starts with the oldest request (alone, if it is over `max_rows`) and
        takes those of its key after it."""

    def want(self, rows: int) -> None:
        """Wake ParallelInference's workers once `rows` examples are queued here (0: no one waits)."""

    def others(self, requests: int) -> None:
        """The other feeds hold `requests` now: the queue limit counts them with this feed's."""


class TicketQueue:
    """ParallelInference's own feed: the Tickets of submit and output, oldest first. Submitters put, workers take,
    under a lock of its own held for a few operations only (submitters and workers never wait on each other's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tickets: deque[Ticket] = deque()
        self._rows = 0
        self._wanted = 0

    def put(self, ticket: Ticket) -> bool:
        """Queue `ticket`; True when it brings the queue to the examples a worker wants (once: then wake them)."""
        with self._lock:
            self._tickets.append(ticket)
            self._rows += ticket.rows
            if self._wanted and self._rows >= self._wanted:
                self._wanted = 0
                return True
            return False

    def remove(self, ticket: Ticket) -> bool:
        """Take `ticket` out if it is still queued."""
        with self._lock:
            try:
                self._tickets.remove(ticket)
            except ValueError:
                return False
            self._rows -= ticket.rows
            return True

    def clear(self) -> list[Ticket]:
        """Every queued ticket, taken out."""
        with self._lock:
            tickets = list(self._tickets)
            self._tickets.clear()
            self._rows = 0
            return tickets

    def queued(self) -> State:
        with self._lock:
            tickets = self._tickets
            return self._rows, len(tickets), tickets[0].submitted if tickets else 0

    def take(self, max_rows: int, max_requests: int, key: Any) -> tuple[list[Ticket], list[Ticket]]:
        """As Feed.take; tickets of other keys are looked past and stay queued in order."""
        now = time.monotonic()
        batch: list[Ticket] = []
        expired: list[Ticket] = []
        kept: list[Ticket] = []
        rows = 0
        with self._lock:
            tickets = self._tickets
            while tickets and rows < max_rows and len(batch) < max_requests:
                ticket = tickets.popleft()
                if ticket.deadline is not None and now > ticket.deadline:
                    expired.append(ticket)
                    self._rows -= ticket.rows
                elif key is None or (ticket.key == key and rows + ticket.rows <= max_rows):
                    key = ticket.key
                    batch.append(ticket)
                    rows += ticket.rows
                else:
                    kept.append(ticket)
            if kept:
                tickets.extendleft(reversed(kept))
            self._rows -= rows
        return batch, expired

    def want(self, rows: int) -> None:
        with self._lock:
            self._wanted = rows

    def others(self, requests: int) -> None:
        """Nothing to keep: ParallelInference counts every feed's requests when it queues a Ticket."""


def take_batch(feeds: Sequence[Feed], states: Sequence[State], max_rows: int,
               max_requests: int) -> tuple[list[Any], int, list[Any]]:
    """The next batch from `feeds` (`states`: their `queued()`): the feed holding the oldest request first, then the
    others by their oldest request, each adding requests of the batch's key, up to `max_rows` examples (a first
    request over it alone) and `max_requests` requests. Returns the batch's items, its examples, and the requests
    found past their deadline."""
    batch: list[Any] = []
    expired: list[Any] = []
    rows = requests = 0
    key = None
    for _, index in sorted((state[2], index) for index, state in enumerate(states) if state[1]):
        items, late = feeds[index].take(max_rows - rows, max_requests - requests, key)
        expired += late
        for item in items:
            batch.append(item)
            rows += item.rows
            requests += len(item.arrivals)
        if batch:
            key = batch[0].key
            if rows >= max_rows or requests >= max_requests:
                break
    return batch, rows, expired


def want_rows(feeds: Sequence[Feed], states: Sequence[State], target: int) -> None:
    """Ask each feed to wake the workers once the feeds hold `target` examples in all (`states`: their `queued()`)."""
    rows = sum(state[0] for state in states)
    for feed, state in zip(feeds, states, strict=True):
        feed.want(target - rows + state[0])


def tell_others(feeds: Sequence[Feed], requests: Sequence[int]) -> None:
    """Tell each feed how many requests the others hold (`requests`: each feed's), for the queue limit."""
    total = sum(requests)
    for feed, held in zip(feeds, requests, strict=True):
        feed.others(total - held)
