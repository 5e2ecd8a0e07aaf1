"""Whether this operator replica may write to the API now: the one check every write passes (the operator's own
through the client `guard` gives cluster.login, kopf's through the session election.py gives it), so that a
replica that may no longer lead never writes.

The check is made as late as each client allows, so that a pause between the check and the request cannot let a
write through: kopf's session (election.guarded_login) checks once its request has a connection, with no wait before
the request is written; the operator's `kubernetes` client (`guard`) checks before each piece of a request it sends,
on a connection already made, so the request is complete at the server only if its last piece passed a check made
just before it (a request cut short by a refusal is dropped with its connection, never applied).

Without --leader-elect a replica always may. With it, a replica may write only while it leads and less than the
renew deadline has passed since it sent its last successful renewal of the Lease: another replica can take the
lease over only a lease duration after it saw that renewal, later still, so a leader that stops renewing (an API
outage, a network partition, a pause under SIGSTOP) stops writing at least lease duration − renew deadline (5 s
by default) before anyone else may start. The clock is monotonic: it runs on while the process is paused, so a
leader resumed after its lease ran out refuses its next write before it has even learned that it lost.

Torch-free and kopf-free.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

READ_VERBS = frozenset({"get", "list", "watch", "head", "options"})


class NotLeading(RuntimeError):
    """A write refused because this replica may not write now (it does not lead, or its lease may have run out)."""


class Leadership:
    """This replica's right to write: `may_write()` until `valid_until` on the monotonic clock."""

    def __init__(self, *, always: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._valid_until = math.inf if always else -math.inf
        self.leading = always

    def renewed(self, sent_at: float, renew_deadline: float) -> None:
        """The Lease was renewed (or acquired) by a request sent at `sent_at` (this clock): writes are allowed until
        `renew_deadline` seconds after it."""
        with self._lock:
            self.leading = True
            self._valid_until = max(self._valid_until, sent_at + renew_deadline)

    def lose(self) -> None:
        """Leadership lost (or given up): no write from now on."""
        with self._lock:
            self.leading = False
            self._valid_until = -math.inf

    def may_write(self) -> bool:
        return self._clock() < self._valid_until

    def seconds_left(self) -> float:
        """How long this replica may still write without a renewal (negative: it may not)."""
        return self._valid_until - self._clock()

    def check(self, verb: str, what: str) -> None:
        """Raise NotLeading for a write (`verb` not a read) this replica may not make now."""
        if verb.lower() not in READ_VERBS and not self.may_write():
            raise NotLeading(f"not writing ({verb} {what}): this operator replica does not hold the leader lease now")


current = Leadership(always=True)
"""The process's leadership: always may write, unless `tandem operator --leader-elect` installs an elected one."""


def install(leadership: Leadership) -> None:
    global current
    current = leadership


class _CheckedConnection:
    """A urllib3 connection that checks each piece of a request with `current` right before sending it."""

    _request: tuple[str, str] = ("GET", "")

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> None:
        self._request = (method, url.split("?", 1)[0])
        super().request(method, url, *args, **kwargs)  # type: ignore[misc]

    def send(self, data: Any) -> None:
        if self.sock is None:  # type: ignore[attr-defined]
            self.connect()  # type: ignore[attr-defined]
        current.check(*self._request)
        super().send(data)  # type: ignore[misc]


class _CheckedHTTPConnection(_CheckedConnection, HTTPConnection):
    pass


class _CheckedHTTPSConnection(_CheckedConnection, HTTPSConnection):
    pass


class _CheckedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _CheckedHTTPConnection


class _CheckedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _CheckedHTTPSConnection


def guard(api: Any) -> Any:
    """`api` (a `kubernetes.client.ApiClient`) with every request checked by `current` as it is sent: a write this
    replica may not make raises NotLeading, and no complete request reaches the API server."""
    manager = api.rest_client.pool_manager
    manager.clear()
    manager.pool_classes_by_scheme = {"http": _CheckedHTTPPool, "https": _CheckedHTTPSPool}
    return api
