"""A server's batching settings from its own InferencePool in the Kubernetes API (`tandem serve --watch-pool`, as the
operator starts its servers): the pool's batchLimit, queueLimit, maxQueueDelayMicroseconds and requestTimeoutMs
reach the running server within a watch event's delay, with no new pod and no failed request.

Why this path and no endpoint (issue 35): a batching change must come from whoever may change the pool, never from a
client of the model. The server reads the pool itself, with its pod's ServiceAccount, which a Role allows get and
watch on that one InferencePool and nothing else (operator/pool_objects.py, as rank 0 may patch only its own job):
no port, no route and no credential to guard, and a pool behind a token takes its changes the same way (the
operator, which never reads Secrets, sends nothing).

- One thread reads: a GET of the pool, then a watch from its resourceVersion (`fieldSelector=metadata.name=...`,
  which the API server authorizes by the Role's resourceNames), renewed every WATCH_SECONDS; after an error (410
  Gone, a refused or failed request) it waits (jittered, capped, at least the server's Retry-After) and starts again
  with a GET, so no change is missed. A refusal (401, 403, 404) is logged once with its fix until a request
  succeeds.
- The event loop applies (`InferenceServer.update_batching`: every process of the pod's group, or none): the newest
  settings the pool holds, once the model is loaded. When the model fails its warm-up at them (BatchingRefused), the
  server keeps its settings and reports the refused ones in its readiness answer's parameters
  (contract.REFUSED_BATCHING_PARAMETER; every process of the group does), where the operator reads them into the
  pool's BatchingDiffers condition; the same settings are tried again after REFUSED_RETRY_SECONDS, others at once.

Only a group's leader watches (its changes reach the other processes, group.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from tandem.api import GROUP, VERSION
from tandem.api.inference import LIVE_FIELDS, BatchingSettings
from tandem.api_errors import Backoff, api_message, retry_after
from tandem.contract import REFUSED_RETRY_SECONDS
from tandem.worker.serve.model_loading import ModelLoadError
from tandem.worker.serve.served_model import BatchingRefused
from tandem.worker.serve.tasks import cancel_and_wait

if TYPE_CHECKING:
    from tandem.worker.serve.app import InferenceServer

log = logging.getLogger("tandem.serve")

PLURAL = "inferencepools"
WATCH_SECONDS = 120
"""How long one watch request lasts before it is renewed from the last resourceVersion seen."""
REQUEST_TIMEOUT = 10.0
BACKOFF = Backoff(base=0.5, cap=8.0)
TRY_AGAIN_SECONDS = 1.0
"""After a change that could not be made for now (a peer process did not answer)."""
IN_CLUSTER_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
FIXES = {
    401: "the pod's credentials were refused: check the ServiceAccount token mounted in its pod",
    403: "the pod's ServiceAccount lacks get or watch on this InferencePool: the operator creates a Role granting "
         "them on this pool (named like the pool's Deployment) and its RoleBinding; check them",
    404: "the InferencePool is not there (deleted, or the manifest names another pool or namespace)",
}


def pool_batching(pool: dict[str, Any]) -> BatchingSettings:
    """The batching settings in a pool as the API holds it (the defaults for fields left out). Raises
    ValidationError."""
    spec = pool.get("spec") or {}
    aliases = [BatchingSettings.model_fields[name].alias for name in LIVE_FIELDS]
    return BatchingSettings.model_validate({alias: spec[alias] for alias in aliases if alias in spec})


def pool_namespace(namespace: str | None) -> str:
    """The manifest's namespace, else the pod's own (in a cluster), else `default`."""
    if namespace:
        return namespace
    with contextlib.suppress(OSError):
        return open(IN_CLUSTER_NAMESPACE).read().strip() or "default"
    return "default"


class PoolWatch:
    """Follows the batching settings of the InferencePool `namespace/name` for `server` (see the module's
    docstring). `start()` on the server's event loop once its model's load has begun; `stop()` there too.
    `retry_seconds`: how long refused settings are left before they are tried again."""

    def __init__(self, server: InferenceServer, name: str, namespace: str | None, *,
                 retry_seconds: float = REFUSED_RETRY_SECONDS, login: Callable[[], Any] | None = None):
        self.server, self.name, self.namespace = server, name, pool_namespace(namespace)
        self.retry_seconds = retry_seconds
        self.wanted: BatchingSettings | None = None
        """The newest batching settings the pool holds (None until it is read)."""
        self._login = login or _login
        self._refused_at = float("-inf")
        self._wake = asyncio.Event()
        self._stopped = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None

    @property
    def pool(self) -> str:
        return f"{self.namespace}/{self.name}"

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._apply())
        self._thread = threading.Thread(target=self._watch, name=f"pool-{self.pool}", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop applying; the reading thread ends at its next event or the end of its watch request (a daemon)."""
        self._stopped.set()
        await cancel_and_wait(self._task)

    # -- the event loop's side ------------------------------------------------------------------------------------
    def want(self, settings: BatchingSettings) -> None:
        """The pool holds `settings` now (what the watch feeds; tests may call it): they are applied soon."""
        if settings != self.wanted:
            self.wanted = settings
            self._wake.set()

    async def _apply(self) -> None:
        try:
            await asyncio.shield(self.server.loading)
        except Exception:  # noqa: BLE001 - the server reports its load error itself
            return
        delay: float | None = 0.0
        while True:
            if delay is None:
                await self._wake.wait()
            elif delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
            self._wake.clear()
            delay = await self.settle()

    async def settle(self) -> float | None:
        """Run with the pool's settings if the server runs others; how long until trying again (None: until the
        pool changes)."""
        wanted, model = self.wanted, self.server.model
        if wanted is None or wanted == model.batching:
            return None
        if model.refused is not None and model.refused[0] == wanted:
            wait = self._refused_at + self.retry_seconds - time.monotonic()
            if wait > 0:
                return wait
        try:
            await self.server.update_batching(wanted)
        except BatchingRefused as error:
            self._refused_at = time.monotonic()
            log.warning("the pool's batching settings (%s) are refused: %s; still running with %s", wanted.summary(),
                        error, model.batching.summary())
            await self._record_refusal(wanted, str(error))
            return self.retry_seconds
        except ModelLoadError as error:  # a peer process did not answer
            log.warning("the pool's batching settings (%s) could not be applied now: %s", wanted.summary(), error)
            return TRY_AGAIN_SECONDS
        return None

    async def _record_refusal(self, settings: BatchingSettings, reason: str) -> None:
        self.server.model.record_refusal(settings, reason)
        peers = self.server.peers
        if peers is not None:
            await asyncio.gather(*(peer.record_refusal(settings, reason) for peer in peers.others),
                                 return_exceptions=True)

    # -- the reading thread ---------------------------------------------------------------------------------------
    def _offer(self, pool: dict[str, Any]) -> None:
        try:
            settings = pool_batching(pool)
        except ValidationError as error:
            log.warning("InferencePool %s holds batching settings this server cannot take: %s", self.pool, error)
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
            self._loop.call_soon_threadsafe(self.want, settings)

    def _watch(self) -> None:
        try:
            api = self._login()
        except Exception as error:  # noqa: BLE001 - no credentials: the server keeps its manifest's settings
            log.error("cannot read InferencePool %s to follow its batching settings: no Kubernetes credentials "
                      "(%s: %s); serving with the manifest's", self.pool, type(error).__name__, error)
            return
        from kubernetes import watch

        version: str | None = None
        attempt, failing = 0, None
        while not self._stopped.is_set():
            try:
                if version is None:
                    pool = api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name,
                                                            _request_timeout=REQUEST_TIMEOUT)
                    self._offer(pool)
                    version = pool["metadata"].get("resourceVersion")
                    attempt, failing = 0, None
                stream = watch.Watch().stream(
                    api.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
                    field_selector=f"metadata.name={self.name}", resource_version=version,
                    timeout_seconds=WATCH_SECONDS, _request_timeout=WATCH_SECONDS + REQUEST_TIMEOUT)
                for event in stream:
                    if self._stopped.is_set():
                        return
                    pool = event.get("object") or {}
                    version = (pool.get("metadata") or {}).get("resourceVersion") or version
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        self._offer(pool)
                continue
            except Exception as error:  # noqa: BLE001 - every failure: wait, then start again from a GET
                status = getattr(error, "status", None)
                version = None
                if status == 410:  # the watch's resourceVersion is too old: read the pool again at once
                    continue
                described = f"{status} {api_message(error)}" if status else f"{type(error).__name__}: {error}"
                if described != failing:
                    fix = FIXES.get(status)
                    log.warning("reading InferencePool %s for its batching settings failed: %s%s; trying again",
                                self.pool, described, f" ({fix})" if fix else "")
                    failing = described
                delay = BACKOFF.delay(attempt, retry_after(error))
                attempt = min(attempt + 1, 10)
            self._stopped.wait(delay)


def _login():
    """The CustomObjectsApi with in-cluster credentials (the pod's ServiceAccount token), else KUBECONFIG's."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration)
    return client.CustomObjectsApi(client.ApiClient(configuration))
