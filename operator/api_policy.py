"""The operator's one policy for API errors, for every call it makes through the `kubernetes` client (creates,
replaces, deletes, status patches) — and, through kopf's settings and a log filter, for kopf's own (watches, its
finalizer and progress patches, Events).

An API error is routine (client-go's view): 429 under API Priority and Fairness, 500/503 while etcd elects a leader,
a timeout, a reset connection. What each answer means, as `classify` decides it:

- 429, 500, 502, 503, 504, a timeout or a connection error: **transient**. Retried within the pass, up to
  `Backoff.attempts` times, after a jittered exponential delay capped at a few seconds (never shorter than the
  server's Retry-After). Still failing: `Unavailable`, and the daemon decides the whole pass again within seconds.
- 409 on a create: the object **exists** (kept; the caller decides whether to replace it). 409 on a replace:
  the decision read an older version than the API holds: `Stale`, the pass is decided again on the newer one.
- 404 on a delete: **done** (it is gone). 404 elsewhere: the object is gone; the caller says what that means.
- 400, 403, 422 and any other 4xx: **refused**, never retried in a loop: `Refused`, which the daemon turns into an
  APIRequestRefused condition on the job or pool naming the call, the API's message and the fix.

Every failed attempt is counted in `tandem_operator_api_errors_total{verb,kind,code}`, every retry in
`tandem_operator_api_retries_total{verb,kind,code}`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from tandem.api_errors import TRANSIENT_CODES, Backoff, api_message
from tandem.api_errors import retry_after as server_wait
from tandem.operator import metrics

log = logging.getLogger("tandem.operator")

REQUEST_TIMEOUT = (5.0, 10.0)
"""(connect, read) seconds for each of the operator's requests: a hung request is a transient error within
seconds, not a stall of the job's daemon."""


BACKOFF = Backoff()


class JitteredDelays:
    """`BACKOFF`'s delays as kopf's `error_backoffs` want them: re-iterable (a fresh jittered series for each of kopf's
    requests) and sized (kopf counts the attempts)."""

    def __init__(self, backoff: Backoff = BACKOFF) -> None:
        self.backoff = backoff

    def __iter__(self) -> Iterator[float]:
        return (self.backoff.delay(attempt) for attempt in range(self.backoff.attempts - 1))

    def __len__(self) -> int:
        return self.backoff.attempts - 1


class ApiFailure(Exception):
    """A call the policy could not complete: what was called, and the API's answer."""

    def __init__(self, verb: str, kind: str, target: str, code: int | str, reason: str, message: str,
                 retry_after: float | None = None) -> None:
        super().__init__(f"{verb} {kind} {target}: {code} {reason}: {message}".rstrip(": "))
        self.verb, self.kind, self.target = verb, kind, target
        self.code, self.reason, self.message, self.retry_after = code, reason, message, retry_after


class Unavailable(ApiFailure):
    """Transient errors on every attempt: the pass is decided again within seconds."""


class Stale(ApiFailure):
    """409 on a replace: the object changed since it was read; the pass is decided again on the newer version."""


class Refused(ApiFailure):
    """400, 403, 422 (or another 4xx): retrying will not help until someone changes something."""

    def fix(self) -> str:
        # A kind's resource is its plural in lower case (every kind the operator writes is regular); a resource
        # name (`paralleltrainingjobs/status`) is used as it is.
        resource = self.kind if self.kind[:1].islower() else self.kind.lower() + "s"
        if self.code == 403:
            return (f"grant the operator's ServiceAccount the verb '{RBAC_VERBS.get(self.verb, self.verb)}' on "
                    f"'{resource}' (the chart's ClusterRole or Role, charts/tandem/templates/rbac.yaml)")
        if self.code == 404:
            return ("install the CRDs of the project that defines the kind (Kueue for Workloads, Volcano or "
                    "scheduler-plugins for PodGroups), or remove what asks for it from the job")
        if self.code == 422 or self.code == 400:
            return ("the API server rejects the object the operator built from the spec: correct the spec field the "
                    "message names, or an admission policy that refuses it")
        return "see the API server's message"


RBAC_VERBS = {"replace": "update"}
"""The RBAC verb of a call, where its name differs."""


def classify(verb: str, code: int | str) -> str:
    """What an answer means for a call: 'exists', 'stale', 'gone', 'transient' or 'refused'. `code` is the HTTP
    status, or 'timeout' / 'connection' when no answer came."""
    if code in ("timeout", "connection") or code in TRANSIENT_CODES:
        return "transient"
    if code == 409:
        return "exists" if verb == "create" else "stale"
    if code == 404:
        return "gone"
    return "refused"


async def call(verb: str, kind: str, target: str, method: Callable[..., Any], *args: Any,
               backoff: Backoff = BACKOFF, timeout: tuple[float, float] = REQUEST_TIMEOUT,
               **kwargs: Any) -> Any:
    """`method(*args, **kwargs)` (a `kubernetes` client call, run in a worker thread) under the policy. Returns its
    result; raises `ApiException` for 'exists' and 'gone' answers (the caller says what they mean), `Stale`,
    `Refused`, or `Unavailable` once the attempts are spent. A write this replica may not make now raises NotLeading
    (from the operator's client: leadership.guard)."""
    for attempt in range(backoff.attempts):
        try:
            return await asyncio.to_thread(method, *args, _request_timeout=timeout, **kwargs)
        except ApiException as error:
            code, reason, message, retry_after = error.status, error.reason or "", api_message(error), \
                server_wait(error)
            outcome = classify(verb, code)
            if outcome in ("exists", "gone"):
                raise
        except (urllib3.exceptions.HTTPError, OSError) as error:
            timed_out = isinstance(error, (urllib3.exceptions.TimeoutError, TimeoutError)) or "timed out" in str(error)
            code, reason, message, retry_after = ("timeout" if timed_out else "connection"), type(error).__name__, \
                str(error), None
            outcome = "transient"
        metrics.API_ERRORS.labels(verb, kind, str(code)).inc()
        if outcome == "stale":
            raise Stale(verb, kind, target, code, reason, message)
        if outcome == "refused":
            log.warning("%s %s %s refused: %s %s: %s", verb, kind, target, code, reason, message)
            raise Refused(verb, kind, target, code, reason, message)
        if attempt + 1 == backoff.attempts:
            log.warning("%s %s %s failed %d times (last: %s %s); the pass is decided again", verb, kind, target,
                        backoff.attempts, code, reason)
            raise Unavailable(verb, kind, target, code, reason, message, retry_after)
        metrics.API_RETRIES.labels(verb, kind, str(code)).inc()
        await asyncio.sleep(backoff.delay(attempt, retry_after))
    raise AssertionError("unreachable")


_KOPF_REQUEST = re.compile(r"Request attempt \S+ failed; (will retry|escalating): (\w+) (\S+) -> (.*)$", re.S)
_STATUS = re.compile(r"status=(\d+)")


class KopfRequestFailures(logging.Filter):
    """kopf's own requests (watches, its finalizer and progress patches, Events) retry under kopf's settings, which
    `configure_kopf` sets to this policy's delays. kopf reports each failed attempt only as a log line: this filter
    counts it in the same metrics (verb, kind, code) and logs a retry as the warning it is, not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        match = _KOPF_REQUEST.search(record.getMessage())
        if match is None:
            return True
        retrying, method, url, error = match.groups()
        code = _STATUS.search(error)
        labels = (method.lower(), _kind_of(url), code.group(1) if code else
                  ("timeout" if "Timeout" in error else "connection"))
        metrics.API_ERRORS.labels(*labels).inc()
        if retrying == "will retry":
            metrics.API_RETRIES.labels(*labels).inc()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _kind_of(url: str) -> str:
    """The resource of a request's URL: `paralleltrainingjobs/status`, `pods`, `events`..."""
    parts = [p for p in url.split("?", 1)[0].split("/") if p]
    for index, part in enumerate(parts):
        if part == "namespaces" and index + 2 < len(parts):
            rest = parts[index + 2:]
            return "/".join(rest[::2] if len(rest) < 3 else [rest[0], rest[2]])
    return parts[-1] if parts else ""


def configure_kopf(settings: Any) -> None:
    """kopf's own retries under the same policy: jittered delays capped at a few seconds, Retry-After honoured,
    requests that time out in seconds."""
    settings.networking.error_backoffs = JitteredDelays()
    settings.networking.request_timeout = REQUEST_TIMEOUT[1]
    settings.networking.connect_timeout = REQUEST_TIMEOUT[0]
    settings.posting.default_backoffs = JitteredDelays()
