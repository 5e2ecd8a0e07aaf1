"""Leader election through a coordination.k8s.io/v1 Lease, as Kubernetes' own controllers elect (client-go's
leaderelection, controller-runtime's defaults: a 15 s lease, a 10 s renew deadline, a 2 s retry period).

- `decide`: what a replica does with the Lease it read: create it, renew it, take it over (released, or not
  renewed for a lease duration by this replica's own clock since it saw the last renewal), or wait.
- `Elector`: one replica's side, in a thread with an event loop of its own (a busy operator loop never delays a
  renewal). It stands by until it holds the lease, then renews it every retry period under the operator's API error
  policy (a 500 or 429 is tried again within the renew deadline, not a reason to give up). If it cannot renew
  within the renew deadline, or finds another holder, it gives leadership up at once (no write from then on:
  leadership.py) and exits the process, which its Deployment restarts as a standby. On a clean stop it releases the
  lease after the operator's last write, so a standby takes over within a retry period.
- `guarded_login`: kopf's own login, with a session whose every write passes leadership's check: kopf's finalizer,
  progress and status patches and Events are refused like the operator's own calls.

Nothing here decides anything about jobs or pools: a replica that leads runs kopf as a single replica would.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tandem.api_errors import Backoff
from tandem.operator import leadership, metrics
from tandem.operator.api_policy import ApiFailure, Stale, call

log = logging.getLogger("tandem.operator")

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
ONE_TRY = Backoff(attempts=1)
"""Each renewal request is tried once: the elector's own loop tries again every retry period until the deadline."""


@dataclass(frozen=True)
class Timing:
    """The election's durations in seconds (client-go's LeaseDuration, RenewDeadline, RetryPeriod)."""

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def problem(self) -> str | None:
        """Why these durations cannot elect safely (None: they can): a leader must stop writing before a standby may
        take over, and try to renew more than once before it gives up."""
        if not 0 < self.retry_period < self.renew_deadline:
            return (f"--leader-elect-retry-period ({self.retry_period:g} s) must be above 0 and shorter than "
                    f"--leader-elect-renew-deadline ({self.renew_deadline:g} s)")
        if not self.renew_deadline < self.lease_duration:
            return (f"--leader-elect-renew-deadline ({self.renew_deadline:g} s) must be shorter than "
                    f"--leader-elect-lease-duration ({self.lease_duration:g} s): a leader that cannot renew stops "
                    "writing at the deadline, before a standby may take the lease over")
        return None


@dataclass(frozen=True)
class LeaseRecord:
    """What a Lease says: its holder ("" once released), for how long, since when, and its version."""

    holder: str
    duration: float | None
    acquire_time: datetime | None
    renew_time: datetime | None
    transitions: int
    resource_version: str

    @classmethod
    def of(cls, lease: client.V1Lease) -> LeaseRecord:
        spec = lease.spec or client.V1LeaseSpec()
        return cls(spec.holder_identity or "", spec.lease_duration_seconds, spec.acquire_time, spec.renew_time,
                   spec.lease_transitions or 0, lease.metadata.resource_version)

    def same_as(self, other: LeaseRecord | None) -> bool:
        """Whether `other` says the same (a renewal changes the renew time; the version alone may change for nothing
        the holder did)."""
        return other is not None and (self.holder, self.duration, self.renew_time, self.transitions) == \
            (other.holder, other.duration, other.renew_time, other.transitions)


Action = Literal["create", "renew", "take", "wait"]


def decide(record: LeaseRecord | None, me: str, seen_at: float, now: float, timing: Timing) -> Action:
    """What replica `me` does with the Lease as read (`record`; None: there is none), first seen as it is at
    `seen_at` on this replica's monotonic clock, at `now`. Another holder's lease runs out a lease duration after
    this replica saw its last renewal: by this replica's clock, never by the renew time the holder wrote (the two
    machines' clocks may differ)."""
    if record is None:
        return "create"
    if record.holder == me:
        return "renew"
    if not record.holder:
        return "take"
    return "take" if now - seen_at >= (record.duration or timing.lease_duration) else "wait"


def lease_manifest(name: str, namespace: str, me: str, record: LeaseRecord | None, action: Action, now: datetime,
                   timing: Timing) -> dict[str, Any]:
    """The Lease `me` writes for `action` (create, renew or take) over `record`: the resource version read (a write
    over a newer one is refused with 409), the transitions counted when the holder changes."""
    taking = action != "renew" or record is None
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if record is not None:
        metadata["resourceVersion"] = record.resource_version
    transitions = 0 if record is None else record.transitions + (1 if action == "take" else 0)
    acquired = now if taking or record.acquire_time is None else record.acquire_time
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
            "spec": {"holderIdentity": me, "leaseDurationSeconds": round(timing.lease_duration),
                     "acquireTime": _micro_time(acquired), "renewTime": _micro_time(now),
                     "leaseTransitions": transitions}}


def released_manifest(name: str, namespace: str, record: LeaseRecord, now: datetime) -> dict[str, Any]:
    """The Lease given up (client-go's ReleaseOnCancel): no holder, a one-second duration, the transitions kept."""
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": record.resource_version},
            "spec": {"holderIdentity": "", "leaseDurationSeconds": 1, "acquireTime": _micro_time(now),
                     "renewTime": _micro_time(now), "leaseTransitions": record.transitions}}


def _micro_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def identity() -> str:
    """This replica's name in the Lease: its pod's (host) name and a unique suffix, as client-go's controllers name
    themselves (a restarted container in the same pod is another candidate)."""
    return f"{socket.gethostname()}_{uuid.uuid4()}"


def default_namespace(watched: list[str]) -> str:
    """Where the Lease lives without --leader-election-namespace: the operator's own namespace in a cluster (its
    ServiceAccount's), else the first namespace it watches, else `default`."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return watched[0] if watched else "default"


def exit_process(code: int) -> None:
    """Leave now, from any thread, running nothing more: the process may no longer write, and its Deployment
    starts it again as a standby."""
    sys.stderr.flush()
    os._exit(code)


class Elector:
    """One replica's part in the election of Lease `name` in `namespace`, as `me`, driving `held` (the process's
    Leadership). `run()` in a thread of its own: `elected` is set once this replica leads; `stop()` releases."""

    def __init__(self, api: client.ApiClient, name: str, namespace: str, me: str, timing: Timing,
                 held: leadership.Leadership, *, lost: Callable[[int], None] = exit_process,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.leases = client.CoordinationV1Api(api)
        self.name, self.namespace, self.me, self.timing = name, namespace, me, timing
        self.held, self.lost, self.clock = held, lost, clock
        self.elected = threading.Event()
        self.record: LeaseRecord | None = None
        self.seen_at = 0.0
        self._stopping = threading.Event()
        self._released = threading.Event()
        self._renewed_at = 0.0  # when the last successful renewal was sent
        self._retry_after: float | None = None  # the server's Retry-After on the last failed write
        metrics.LEADER.set(0)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=lambda: asyncio.run(self.run()), name="tandem-leader-election", daemon=True)
        thread.start()
        return thread

    def stop(self, timeout: float | None = None) -> None:
        """Give leadership up (after the operator's last write) and release the lease; returns once released or
        after `timeout`."""
        self._stopping.set()
        self._released.wait(timeout if timeout is not None else self.timing.retry_period * 2)

    async def run(self) -> None:
        try:
            if await self._acquire():
                await self._keep()
        finally:
            self._step_down()
            self._released.set()

    # -- standing by ---------------------------------------------------------------------------------------------

    async def _acquire(self) -> bool:
        """Stand by until this replica holds the lease (True), or stop (False)."""
        log.info("leader election: standing by for Lease %s/%s as %s", self.namespace, self.name, self.me)
        while not self._stopping.is_set():
            await self._read()
            action = decide(self.record, self.me, self.seen_at, self.clock(), self.timing)
            if action != "wait" and await self._write(action):
                log.info("leader election: %s now leads (Lease %s/%s, %s)", self.me, self.namespace, self.name,
                         "created" if action == "create" else "taken over" if action == "take" else "still held")
                metrics.LEADER.set(1)
                self.elected.set()
                return True
            await self._pause(self._until_expiry() if action == "wait" else self.timing.retry_period)
        return False

    def _until_expiry(self) -> float:
        """Seconds until the next read: when the lease as last seen runs out, at most a quarter of the retry period
        (a standby sees each renewal within that of it, and so takes over within lease duration + retry period / 4
        of the leader's last renewal)."""
        record = self.record
        duration = (record.duration if record and record.duration else self.timing.lease_duration)
        return max(0.05, min(self.timing.retry_period / 4, self.seen_at + duration - self.clock()))

    # -- leading -------------------------------------------------------------------------------------------------

    async def _keep(self) -> None:
        """Renew every retry period until stopped (then release); give up and exit if a renewal cannot be made
        within the renew deadline of the last one, or another replica holds the lease."""
        while True:
            await self._pause(self.timing.retry_period)
            if self._stopping.is_set():
                await self._release()
                return
            if not await self._renew():
                self._step_down()
                log.error("leader election: leadership of Lease %s/%s lost (%s); exiting, to stand by again",
                          self.namespace, self.name, self._lost_why())
                self.lost(1)
                return

    async def _renew(self) -> bool:
        """Renew, trying again (after half a retry period, or the server's Retry-After) until the renew deadline of
        the last renewal: False if it passes first, or another replica holds the lease."""
        deadline = self._renewed_at + self.timing.renew_deadline
        while self.clock() < deadline and not self._stopping.is_set():
            if await self._write("create" if self.record is None else "renew"):
                return True
            if self.record is not None and self.record.holder != self.me:
                return False
            wait = max(self.timing.retry_period / 2, self._retry_after or 0.0)
            await self._pause(min(wait, max(0.0, deadline - self.clock())))
        return self._stopping.is_set()

    def _step_down(self) -> None:
        """No write from now on, and the metric says so."""
        self.held.lose()
        metrics.LEADER.set(0)

    def _lost_why(self) -> str:
        if self.record is not None and self.record.holder != self.me:
            return f"held by {self.record.holder or 'nobody'}"
        return f"not renewed within {self.timing.renew_deadline:g} s"

    async def _release(self) -> None:
        """Release the lease if this replica still holds it: no holder, a one-second duration."""
        self._step_down()
        if self.record is None or self.record.holder != self.me:
            return
        body = released_manifest(self.name, self.namespace, self.record, datetime.now(UTC))
        try:
            await call("release", "leases", self.name, self.leases.replace_namespaced_lease, self.name,
                       self.namespace, body, backoff=Backoff(attempts=3, cap=0.5), timeout=self._timeout())
            log.info("leader election: %s released Lease %s/%s", self.me, self.namespace, self.name)
        except (ApiFailure, ApiException) as error:
            log.warning("leader election: could not release Lease %s/%s (%s): a standby takes over once it runs "
                        "out", self.namespace, self.name, error)

    # -- the API -------------------------------------------------------------------------------------------------

    async def _read(self) -> None:
        try:
            lease = await call("get", "leases", self.name, self.leases.read_namespaced_lease, self.name,
                               self.namespace, backoff=ONE_TRY, timeout=self._timeout())
        except ApiException as error:  # 404: there is none
            if error.status == 404:
                self._saw(None)
            return
        except ApiFailure as error:
            log.warning("leader election: reading Lease %s/%s failed (%s); trying again", self.namespace,
                        self.name, error)
            return
        self._saw(LeaseRecord.of(lease))

    async def _write(self, action: Action) -> bool:
        """Create, renew or take the lease over the record last read: True once the API has it."""
        body = lease_manifest(self.name, self.namespace, self.me, self.record, action, datetime.now(UTC),
                              self.timing)
        sent = self.clock()
        try:
            if action == "create":
                lease = await call("create", "leases", self.name, self.leases.create_namespaced_lease,
                                   self.namespace, body, backoff=ONE_TRY, timeout=self._timeout())
            else:
                lease = await call("replace", "leases", self.name, self.leases.replace_namespaced_lease, self.name,
                                   self.namespace, body, backoff=ONE_TRY, timeout=self._timeout())
        except Stale:  # another replica wrote it since it was read
            await self._read()
            return False
        except ApiException as error:  # 409 on create (another replica created it), 404 (deleted): read again
            log.info("leader election: %s of Lease %s/%s: %s %s", action, self.namespace, self.name, error.status,
                     error.reason)
            await self._read()
            return False
        except ApiFailure as error:
            log.warning("leader election: %s of Lease %s/%s failed (%s); trying again", action, self.namespace,
                        self.name, error)
            self._retry_after = error.retry_after
            return False
        self._retry_after = None
        self._saw(LeaseRecord.of(lease))
        self._renewed_at = sent
        self.held.renewed(sent, self.timing.renew_deadline)
        return True

    def _saw(self, record: LeaseRecord | None) -> None:
        if record is None or not record.same_as(self.record):
            self.seen_at = self.clock()
        self.record = record
        if record is not None:
            metrics.LEADER_TRANSITIONS.set(record.transitions)

    def _timeout(self) -> tuple[float, float]:
        """Each request's (connect, read) limit: a hung request must not outlast the renew deadline."""
        return self.timing.retry_period, self.timing.retry_period

    async def _pause(self, seconds: float) -> None:
        """Sleep `seconds`, or less if stopped meanwhile."""
        end = self.clock() + seconds
        while not self._stopping.is_set() and (left := end - self.clock()) > 0:
            await asyncio.sleep(min(left, 0.1))


async def guarded_login(**kwargs: Any) -> Any:
    """kopf's login (`kopf.login_via_client`: in-cluster credentials, else KUBECONFIG) as a session whose every
    write passes leadership's check before it is sent (kopf's on.login handler)."""
    import aiohttp
    import kopf

    info = kopf.login_via_client(**kwargs)
    if info is None:
        raise kopf.LoginError("no in-cluster credentials and no KUBECONFIG to log in with")

    async def check(_session: Any, request: Any, params: aiohttp.TraceRequestStartParams) -> None:
        request.what = (params.method, str(params.url.path))
        leadership.current.check(*request.what)

    async def check_again(_session: Any, request: Any, _params: Any) -> None:
        leadership.current.check(*request.what)

    # Checked as the request starts, and again once it has its connection: the request is written then, with no
    # wait in between (a connection may take a while to get: the process may be paused meanwhile).
    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(check)
    trace.on_connection_reuseconn.append(check_again)
    trace.on_connection_create_end.append(check_again)
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ssl=info.as_ssl_context()), headers=info.as_http_headers(),
        proxy=info.proxy_url, trust_env=info.trust_env, trace_configs=[trace])
    return kopf.AiohttpSession(aiohttp_session=session, server=info.server, default_namespace=info.default_namespace,
                               priority=info.priority, expiration=info.expiration)
