"""The InferencePool data plane: ParallelInference behind the Open Inference Protocol (v2) over HTTP.

    tandem serve examples/digits-pool.yaml --port 8000 --checkpoint runs/digits-train/checkpoints

Endpoints (KServe/Triton v2, with Triton's binary tensor, model configuration, statistics and model
repository extensions):

    GET  /v2/health/live | /v2/health/ready            200 {"live": true} / {"ready": true}; not ready: 503
    GET  /v2                                           server metadata
    GET  /v2/models/{m}[/versions/{v}]                 inputs and outputs (shapes with -1 for the batch)
    GET  /v2/models/{m}[/versions/{v}]/ready
    POST /v2/models/{m}[/versions/{v}]/infer           JSON tensors or binary tensor data, both directions
    GET  /v2/models/{m}[/versions/{v}]/config          Triton's model configuration (for perf_analyzer)
    GET  /v2/models[/{m}[/versions/{v}]]/stats         Triton's statistics shape
    POST /v2/repository/index
    POST /v2/repository/models/{m}/load                {"parameters": {"checkpoint": PATH}}: hot swap
    GET  /metrics                                      Prometheus

Errors are {"error": "..."} naming the problem: 400 bad request, 404 unknown model/version/endpoint, 413 body
too large, 429 queue full (with Retry-After), 503 loading or shutting down, 504 timed out, 500 the model's
forward failed (only the request that breaks it fails: a failing batch is retried request by request).

HTTP is tandem.worker.serve.http (an asyncio protocol over httptools, on uvloop); the event loop only parses,
validates and encodes, with numpy and orjson, and never calls torch. Forwards run on ParallelInference's worker
threads, whose results come back to the loop in bursts (one wake-up for a whole batch); request timeouts are
one sweep every 20 ms, not a timer each. Readiness turns on after the model is loaded and warmed up at every
batch size in use; SIGTERM turns it off, lets queued and running requests finish within a grace period, answers
503 to those still unanswered when it ends (a forward still running is not waited for), and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import heapq
import logging
import math
import os
import re
import signal
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import tandem
from tandem.api.inference import InferencePool
from tandem.worker.serve import model_loading as model_source
from tandem.worker.serve.http import HttpServer, Request
from tandem.worker.serve.inference import (
    InferenceTimeout,
    ParallelInference,
    QueueFullError,
    ShutDownError,
    warmup_sizes,
)
from tandem.worker.serve.metrics import OUTCOMES, registry_for
from tandem.worker.serve.model_loading import LoadedModel, ModelLoadError
from tandem.worker.serve.protocol import HEADER_LENGTH, ProtocolError, decode_request, dumps, encode_response

log = logging.getLogger("tandem.serve")

EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "statistics", "parameters"]
MAX_BODY = 1 << 20  # until a model is loaded; then room for a full batch as JSON (_body_limit)
RETRY_AFTER_SECONDS = "1"
TIMEOUT_SWEEP_S = 0.02
_HEADER_LENGTH_KEY = HEADER_LENGTH.lower()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (a dependency on Linux and macOS; measured in
    bench/RESULTS.md), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


Reply = tuple[int, bytes, str, dict[str, str] | None]
JSON = "application/json"
_MODEL_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(?:/(infer|ready|config|stats))?$")
_REPOSITORY_PATH = re.compile(r"^/v2/repository/models/([^/]+)/(load|unload)$")


def _json(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
    return status, dumps(value), JSON, headers


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Reply:
    return _json({"error": message}, status, headers)


class _Completions:
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


class _Pending:
    """An inference request between submit and answer: answered once, by its output, its timeout or its
    client going away."""

    __slots__ = ("server", "request", "decoded", "signature", "ticket", "deadline", "timeout", "finished")

    def __init__(self, server: InferenceServer, request: Request, decoded, signature, timeout: float,
                 deadline: float):
        self.server = server
        self.request = request
        self.decoded = decoded
        self.signature = signature
        self.timeout = timeout
        self.deadline = deadline
        self.ticket = None
        self.finished = False

    def post(self, output: Any, error: BaseException | None) -> None:
        """ParallelInference's callback, on a worker thread: answer on the event loop."""
        self.server._completions.post(self.done, output, error)

    def done(self, output: Any, error: BaseException | None) -> None:
        if self.finished:
            return
        request, decoded = self.request, self.decoded
        self._finish()
        server = self.server
        if error is None:
            body, content_type, header_length = encode_response(output, decoded, server.name, server.version,
                                                                self.signature)
            server.outcomes["success"] += 1
            headers = None if header_length is None else {HEADER_LENGTH: str(header_length)}
            request.respond(200, body, content_type, headers)
            return
        server.outcomes["failed"] += 1
        status = 504 if isinstance(error, InferenceTimeout) else 503 if isinstance(error, ShutDownError) else 500
        request.respond(*_error(status, str(error)))

    def expire(self) -> None:
        """Past the deadline (the timeout sweep): answer 504 unless answered already."""
        if not self.finished:
            self.ticket.cancel()
            milliseconds = f"{self.timeout * 1000:.0f} ms"
            if self.timeout == self.server.spec.request_timeout_ms / 1000:
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
        self.request = self.decoded = None  # it may wait in the timeout sweep's queue a while: keep it light
        server = self.server
        server.in_flight -= 1
        if server.in_flight == 0 and server.draining:
            server._idle.set()


class InferenceServer:
    """One InferencePool's model behind the Open Inference Protocol, on this machine.

    `checkpoint` (a checkpoint file, or a directory whose latest checkpoint is served) overrides the pool's
    spec.model. Use `run()` for the process (`tandem serve`), `start()`/`drain()`/`stop()` on a running event
    loop, or `start_in_thread()` to embed it in a program (tests do)."""

    def __init__(self, pool: InferencePool, checkpoint: str | None = None, *, grace_seconds: float = 25.0,
                 follow_interval: float = 2.0):
        spec = pool.spec
        self.spec = spec
        self.name = spec.model.name or pool.metadata.name
        self.version = spec.model.version
        self.origin = model_source.resolve_origin(spec.model, checkpoint)
        self.grace_seconds = grace_seconds
        self.follow_interval = follow_interval
        self.inference: ParallelInference | None = None
        self.loaded: LoadedModel | None = None
        self.ready = False
        self.draining = False
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.in_flight = 0
        self.max_body = MAX_BODY
        self.port: int | None = None
        self.registry = registry_for(self._metrics_state)
        self._http: HttpServer | None = None
        self._completions: _Completions | None = None
        self._idle: asyncio.Event | None = None
        self._swap_lock: asyncio.Lock | None = None
        self._tasks: list[asyncio.Task] = []
        # Inference requests by deadline, for the timeout sweep: those with the pool's timeout arrive in deadline
        # order (a deque); shorter per-request timeouts go to a heap. One sweep every TIMEOUT_SWEEP_S instead of
        # a timer per request (which cost ~13% of throughput).
        self._deadlines: deque[_Pending] = deque()
        self._early: list[tuple[float, int, _Pending]] = []
        self._early_count = 0
        self.loading: asyncio.Task | None = None
        self._owns_process = False  # run() (tandem serve): process-wide tuning such as freezing the heap
        self._infer_paths = {  # the hot path, matched before any pattern
            f"/v2/models/{self.name}/infer": (self.name, None),
            f"/v2/models/{self.name}/versions/{self.version}/infer": (self.name, self.version),
        }
        self._routes = {  # fixed paths; /v2/models/... and /v2/repository/models/... are matched by pattern
            "/v2/health/live": ("GET", self._live),
            "/v2/health/ready": ("GET", self._ready),
            "/v2": ("GET", self._server_metadata),
            "/v2/models/stats": ("GET", self._stats),
            "/v2/repository/index": ("POST", self._index),
            "/metrics": ("GET", self._metrics),
        }

    # -- lifecycle --------------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen (port 0: any free port; returned), then load and warm up the model in the background
        (`self.loading`); live at once, ready once loaded."""
        loop = self._loop = asyncio.get_running_loop()
        self._completions = _Completions(loop)
        self._idle = asyncio.Event()
        self._swap_lock = asyncio.Lock()
        self._http = HttpServer(self._handle, lambda: self.max_body, on_error=_log_crash)
        self.port = await self._http.start(host, port)
        self.loading = asyncio.create_task(self._first_load())
        self._tasks.append(asyncio.create_task(self._sweep_timeouts()))
        return self.port

    async def _sweep_timeouts(self) -> None:
        loop = asyncio.get_running_loop()
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

    def _handle(self, request: Request):
        """Route a request; answer it now, or return a coroutine that will (loads), or let inference answer."""
        method, path = request.method, request.path
        fast = self._infer_paths.get(path)
        if fast is not None and method == "POST":
            return self._infer(request, *fast)
        try:
            match = _MODEL_PATH.match(path)
            if match is not None:
                name, version, action = match.groups()
                if action == "infer":
                    _allow(method, "POST", path)
                    return self._infer(request, name, version)
                _allow(method, "GET", path)
                self._check_model(name, version)
                if action is None:
                    reply = self._model_metadata()
                elif action == "ready":
                    reply = self._model_ready()
                elif action == "config":
                    reply = self._config()
                else:
                    reply = self._stats()
            elif path in self._routes:
                wanted, handler = self._routes[path]
                _allow(method, wanted, path)
                reply = handler()
            elif (match := _REPOSITORY_PATH.match(path)) is not None:
                _allow(method, "POST", path)
                self._check_model(match.group(1), None)
                if match.group(2) == "unload":
                    reply = self._unload()
                else:
                    return self._load(request)
            else:
                reply = _error(404, f"no endpoint {method} {path}; the inference protocol (v2) is under /v2")
        except ProtocolError as error:
            reply = _error(error.status, str(error), error.headers)
        request.respond(*reply)
        return None

    async def _first_load(self) -> None:
        loop = asyncio.get_running_loop()
        origin = self.origin
        if origin.directory is not None and origin.follow and model_source.current_checkpoint(origin) is None:
            log.info("waiting for the first checkpoint in %s", origin.directory)
            while model_source.current_checkpoint(origin) is None:
                await asyncio.sleep(self.follow_interval)
        loaded = await loop.run_in_executor(None, self._load_model, None)
        self.inference = await loop.run_in_executor(None, self._start_inference, loaded)
        self.loaded = loaded
        self.max_body = _body_limit(loaded)
        self.ready = True
        if origin.directory is not None and origin.follow:
            self._tasks.append(asyncio.create_task(self._follow()))

    def _load_model(self, checkpoint: Path | None) -> LoadedModel:
        return model_source.load(self.origin, self.spec.model, self.spec.batch_limit, checkpoint)

    def _start_inference(self, loaded: LoadedModel) -> ParallelInference:
        spec = self.spec
        return ParallelInference(
            loaded.module, mode=spec.inference_mode, workers=spec.workers_per_replica, batch_limit=spec.batch_limit,
            queue_limit=spec.queue_limit, max_delay_us=spec.max_queue_delay_microseconds, example=loaded.example)

    async def swap(self, checkpoint: Path | None = None) -> LoadedModel:
        """Load `checkpoint` (a file or a directory's latest; None: the origin's current model), warm it up, and
        switch to it atomically. Requests keep being served by the old model until the switch and none fails.
        Raises ModelLoadError (the old model keeps serving)."""
        if self.inference is None or self.loaded is None:
            raise ModelLoadError("the server's first model is still loading")
        if checkpoint is not None and checkpoint.is_dir():
            latest = model_source.checkpoints.latest(checkpoint)
            if latest is None:
                raise ModelLoadError(f"{checkpoint}: no checkpoint in this directory")
            checkpoint = latest
        loop = asyncio.get_running_loop()
        async with self._swap_lock:
            loaded = await loop.run_in_executor(None, self._load_model, checkpoint)
            model_source.check_compatible(self.loaded.signature, loaded.signature, loaded.checkpoint or loaded.source)
            try:
                await loop.run_in_executor(None, self.inference.update_model, loaded.module)
            except Exception as error:  # warm-up of the new replicas failed: the old ones still serve
                raise ModelLoadError(f"the new model fails its warm-up: {type(error).__name__}: {error}") from error
            self.loaded = loaded
        if self._owns_process:
            _freeze_heap()
        log.info("now serving %s", loaded.checkpoint or loaded.source)
        return loaded

    async def _follow(self) -> None:
        """Hot-swap each new checkpoint the training job writes (fromTrainingJob with follow). Only a checkpoint
        not seen before is loaded: one that fails is not retried, and a checkpoint loaded by hand through
        the repository API stays until the job writes a newer one."""
        seen = self.loaded.checkpoint
        while True:
            await asyncio.sleep(self.follow_interval)
            latest = model_source.current_checkpoint(self.origin)
            if latest is None or str(latest) == seen:
                continue
            seen = str(latest)
            try:
                await self.swap(latest)
            except ModelLoadError as error:
                log.error("not switching to %s: %s", latest, error)

    async def drain(self, grace_seconds: float | None = None) -> bool:
        """Turn not-ready, refuse new inference requests, wait up to the grace period for the ones received to
        be answered, then stop: requests still unanswered then get 503, and forwards still running are not
        waited for past the grace period. True when everything was answered in time."""
        self.ready = False
        self.draining = True
        grace = self.grace_seconds if grace_seconds is None else grace_seconds
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        drained = True
        if self.in_flight:
            self._idle.clear()
            log.info("draining %d requests (grace period %g s)", self.in_flight, grace)
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except TimeoutError:
                drained = False
                log.warning("grace period over with %d requests unanswered: answering them 503", self.in_flight)
        await self.stop(worker_timeout=max(0.0, deadline - loop.time()),
                        why=f"grace period of {grace:g} s over")
        return drained

    async def stop(self, worker_timeout: float = 10.0, why: str = "shutting down") -> None:
        """Stop now: refuse new requests, answer every inference request not answered yet with 503 (`why` says
        why), wait up to `worker_timeout` seconds for forwards still running (a forward cannot be interrupted;
        the workers are daemon threads), close every connection."""
        self.ready = False
        self.draining = True
        for task in [*self._tasks, self.loading]:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        inference = self.inference
        if inference is not None:
            inference.shutdown(drain=False, timeout=0)  # refuses new requests, fails the queued ones
        unanswered = [*self._deadlines, *(entry[2] for entry in self._early)]
        self._deadlines.clear()
        self._early.clear()
        for pending in unanswered:  # their answers are written before the connections close below
            pending.cut_off(why)
        if inference is not None and worker_timeout > 0:
            await asyncio.to_thread(inference.shutdown, drain=False, timeout=worker_timeout)
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def run(self, host: str, port: int) -> int:
        """The `tandem serve` process: serve until SIGTERM or SIGINT, then drain; 0 after a drain, 1 when the
        model cannot be loaded."""
        loop = asyncio.get_running_loop()
        self._owns_process = True
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await self.start(host, port)
        log.info("listening on http://%s:%d (live; ready once the model is loaded and warmed up)", host, self.port)
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({self.loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if self.loading.done() and self.loading.exception() is not None:
            error = self.loading.exception()
            log.error("cannot serve model %r: %s", self.name, error)
            stopping.cancel()
            await self.stop()
            return 1
        if not stop.is_set():
            _freeze_heap()
            spec = self.spec
            log.info("ready: model %r version %s from %s; %s, %d worker(s), batch limit %d, queue limit %d",
                     self.name, self.version, self.loaded.checkpoint or self.loaded.source, spec.inference_mode,
                     spec.workers_per_replica, spec.batch_limit, spec.queue_limit)
        await stopping
        log.info("stopping: not ready; finishing requests already received")
        drained = await self.drain()
        log.info("stopped%s", "" if drained else " (some requests were cut off by the grace period)")
        return 0

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0, ready_timeout: float = 120.0) -> BackgroundServer:
        """Run the server on an event loop in a background thread; returns once it is ready (or raises the
        load error)."""
        return BackgroundServer(self, host, port, ready_timeout)

    # -- health and metadata --------------------------------------------------------------------------------

    def _live(self) -> Reply:
        return _json({"live": True})

    def _ready(self) -> Reply:
        return _json({"ready": self.ready}, 200 if self.ready else 503)

    def _server_metadata(self) -> Reply:
        return _json({"name": "tandem", "version": tandem.__version__, "extensions": EXTENSIONS})

    def _check_model(self, name: str, version: str | None) -> None:
        if name != self.name:
            raise ProtocolError(f"unknown model {name!r}: this server serves {self.name!r}", 404)
        if version is not None and version != self.version:
            raise ProtocolError(f"model {name!r} has no version {version!r}; available: {self.version}", 404)

    def _signature(self):
        loaded = self.loaded
        if loaded is None:
            raise ProtocolError(f"model {self.name!r} is not loaded yet", 503)
        return loaded.signature

    def _model_metadata(self) -> Reply:
        return _json(self._signature().metadata(self.name, [self.version]))

    def _model_ready(self) -> Reply:
        return _json({"name": self.name, "ready": self.ready}, 200 if self.ready else 503)

    def _config(self) -> Reply:
        signature = self._signature()
        spec = self.spec
        kind = "KIND_GPU" if any(d.type == "cuda" for d in self.inference.devices) else "KIND_CPU"
        preferred = warmup_sizes(spec.inference_mode, spec.batch_limit) if spec.inference_mode == "batched" else []
        return _json(signature.config(
            self.name, instances=spec.workers_per_replica, kind=kind,
            max_queue_delay_us=spec.max_queue_delay_microseconds, preferred=preferred,
            queue_limit=spec.queue_limit, timeout_us=spec.request_timeout_ms * 1000))

    def _stats(self) -> Reply:
        stats = self.inference.stats.snapshot() if self.inference is not None else None
        return _json({"model_stats": [] if stats is None else [_triton_stats(self.name, self.version, stats)]})

    def _index(self) -> Reply:
        state = "READY" if self.ready else ("UNAVAILABLE" if self.draining else "LOADING")
        reason = self.loaded.checkpoint or self.loaded.source if self.loaded else ""
        return _json([{"name": self.name, "version": self.version, "state": state, "reason": reason or ""}])

    def _metrics(self) -> Reply:
        return 200, generate_latest(self.registry), CONTENT_TYPE_LATEST, None

    def _metrics_state(self) -> dict[str, Any]:
        inference = self.inference
        return {
            "model": self.name, "outcomes": dict(self.outcomes), "pending": self.in_flight, "ready": self.ready,
            "stats": None if inference is None else inference.stats.snapshot(), "batch_limit": self.spec.batch_limit,
        }

    # -- model repository -----------------------------------------------------------------------------------

    async def _load(self, request: Request) -> None:
        try:
            checkpoint = _load_checkpoint_parameter(request.body)
            loaded = await self.swap(None if checkpoint is None else Path(checkpoint))
        except ProtocolError as error:
            reply = _error(error.status, str(error))
        except ModelLoadError as error:
            serving = self.loaded.checkpoint or self.loaded.source if self.loaded else "nothing yet"
            reply = _error(400, f"model {self.name!r} not loaded: {error} (still serving {serving})")
        else:
            reply = _json({"name": self.name, "version": self.version, "checkpoint": loaded.checkpoint,
                           "source": loaded.source})
        request.respond(*reply)

    def _unload(self) -> Reply:
        return _error(400, f"unloading is not supported: this server serves only {self.name!r}; stop the server "
                      "(SIGTERM drains it) or load another checkpoint")

    # -- inference --------------------------------------------------------------------------------------

    def _infer(self, request: Request, name: str, version: str | None) -> None:
        """Validate and queue an inference request; its answer is written when the output comes back (on the
        event loop, through _Completions), when it times out, or never if the client goes away."""
        outcomes = self.outcomes
        try:
            self._check_model(name, version)
            signature = self._signature()
            if self.draining or self.inference is None:
                why = "shutting down" if self.draining else "loading its model"
                raise ProtocolError(f"the server is {why}", 503, {"Retry-After": RETRY_AFTER_SECONDS})
            decoded = decode_request(request.body, request.headers.get(_HEADER_LENGTH_KEY), signature)
        except ProtocolError as error:
            outcomes["invalid" if error.status < 500 else "failed"] += 1
            request.respond(*_error(error.status, str(error), error.headers))
            return
        default = timeout = self.spec.request_timeout_ms / 1000
        if decoded.timeout_us is not None:
            timeout = min(timeout, decoded.timeout_us / 1e6)
        pending = _Pending(self, request, decoded, signature, timeout, self._loop.time() + timeout)
        try:
            pending.ticket = self.inference.submit(decoded.x, pending.post, timeout=timeout)
        except QueueFullError as error:
            outcomes["rejected"] += 1
            request.respond(*_error(429, str(error), {"Retry-After": RETRY_AFTER_SECONDS}))
            return
        except ShutDownError as error:
            outcomes["failed"] += 1
            request.respond(*_error(503, str(error), {"Retry-After": RETRY_AFTER_SECONDS}))
            return
        self.in_flight += 1
        if timeout == default:
            self._deadlines.append(pending)
        else:
            self._early_count += 1
            heapq.heappush(self._early, (pending.deadline, self._early_count, pending))
        request.on_abort = pending.abort


def _freeze_heap() -> None:
    """Move everything alive now (torch, the model, imported modules: hundreds of thousands of objects) out of
    the cyclic garbage collector's sight. Without it every full collection walks them all while requests
    allocate: measured at about a third of the event loop's time per request. Only for a process that is
    just a server (tandem serve)."""
    gc.collect()
    gc.freeze()


def _allow(method: str, allowed: str, path: str) -> None:
    if method != allowed:
        raise ProtocolError(f"{method} is not allowed on {path}; use {allowed}", 405, {"Allow": allowed})


def _log_crash(request: Request, error: BaseException) -> None:
    log.error("unexpected error serving %s %s", request.method, request.path, exc_info=error)


def _body_limit(loaded: LoadedModel) -> int:
    """Room for a full batch as JSON (numbers up to ~24 characters) plus slack, and never less than 1 MiB."""
    signature = loaded.signature
    elements = signature.max_batch_size * math.prod(signature.input.shape)
    return max(1 << 20, elements * 32 + (64 << 10))


def _load_checkpoint_parameter(body: bytes) -> str | None:
    """The checkpoint path of a load request: {"parameters": {"checkpoint": PATH}}, or tritonclient's
    load_model(name, config='{"checkpoint": PATH}'). An empty body reloads the current source."""
    if not body.strip():
        return None
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise ProtocolError(f"malformed JSON in the load request: {error}") from None
    parameters = request.get("parameters", {}) if isinstance(request, dict) else None
    if not isinstance(parameters, dict):
        raise ProtocolError('a load request is {"parameters": {"checkpoint": PATH}}')
    unknown = sorted(set(parameters) - {"checkpoint", "config"})
    if unknown:
        raise ProtocolError(f"unknown load parameter(s) {', '.join(unknown)}; use checkpoint (a checkpoint path on "
                            "the server)")
    checkpoint = parameters.get("checkpoint")
    if "config" in parameters:
        try:
            config = orjson.loads(parameters["config"])
        except (orjson.JSONDecodeError, TypeError):
            config = None
        if not isinstance(config, dict) or set(config) != {"checkpoint"}:
            raise ProtocolError('parameters.config must be a JSON object {"checkpoint": PATH}')
        checkpoint = config["checkpoint"]
    if checkpoint is not None and (not isinstance(checkpoint, str) or not checkpoint):
        raise ProtocolError(f"parameters.checkpoint must be a path; got {checkpoint!r}")
    return checkpoint


def _triton_stats(name: str, version: str, stats: dict[str, Any]) -> dict[str, Any]:
    def duration(count: int, ns: int) -> dict[str, int]:
        return {"count": count, "ns": ns}

    compute = stats["compute_count"]
    return {
        "name": name, "version": version, "last_inference": stats["last_inference_ms"],
        "inference_count": stats["inference_count"], "execution_count": stats["execution_count"],
        "inference_stats": {
            "success": duration(stats["success_count"], stats["success_ns"]),
            "fail": duration(stats["fail_count"], stats["fail_ns"]),
            "queue": duration(stats["queue_count"], stats["queue_ns"]),
            "compute_input": duration(compute, stats["compute_input_ns"]),
            "compute_infer": duration(compute, stats["compute_infer_ns"]),
            "compute_output": duration(compute, stats["compute_output_ns"]),
            "cache_hit": duration(0, 0), "cache_miss": duration(0, 0),
            "rejected": duration(stats["rejected_count"], 0),
        },
        "batch_stats": [
            {"batch_size": size, "compute_input": duration(count, input_ns),
             "compute_infer": duration(count, infer_ns), "compute_output": duration(count, output_ns)}
            for size, (count, input_ns, infer_ns, output_ns) in sorted(stats["batches"].items())
        ],
        "memory_usage": [],
    }


class BackgroundServer:
    """An InferenceServer on its own event loop in a daemon thread (for embedding, and for tests)."""

    def __init__(self, server: InferenceServer, host: str, port: int, ready_timeout: float):
        self.server = server
        self.host = host
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-serve", daemon=True)
        self._thread.start()
        self.port = self._call(server.start(host, port), ready_timeout)
        try:
            self._call(self._wait_loaded(), ready_timeout)
        except BaseException:
            self.stop()
            raise

    async def _wait_loaded(self) -> None:
        await self.server.loading

    def _call(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    @property
    def url(self) -> str:
        return f"{self.host}:{self.port}"

    def swap(self, checkpoint: str | Path | None = None, timeout: float = 120.0) -> LoadedModel:
        return self._call(self.server.swap(None if checkpoint is None else Path(checkpoint)), timeout)

    def drain(self, grace_seconds: float | None = None, timeout: float = 120.0) -> bool:
        result = self._call(self.server.drain(grace_seconds), timeout)
        self._close_loop()
        return result

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._call(self.server.stop(), 60)
        self._close_loop()

    def _close_loop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _configure_threads(pool: InferencePool) -> None:
    """On CPU, split the cores between the worker replicas (unless OMP_NUM_THREADS says otherwise), so that N
    replicas running at once do not oversubscribe the cores."""
    import torch

    if os.environ.get("OMP_NUM_THREADS") or (pool.spec.gpus_per_replica and torch.cuda.is_available()):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // pool.spec.workers_per_replica))


def serve_cli(args) -> int:
    """`tandem serve FILE [--port P] [--host H] [--checkpoint PATH] [--grace-period S]`."""
    from tandem.manifest import ManifestError, load_one

    logging.basicConfig(level=logging.INFO, format="tandem serve: %(message)s", stream=sys.stderr)
    try:
        pool = load_one(args.file, InferencePool)
        server = InferenceServer(pool, args.checkpoint, grace_seconds=getattr(args, "grace_period", 25.0))
    except (ManifestError, ModelLoadError) as error:
        print(error, file=sys.stderr)
        return 1
    _configure_threads(pool)
    port = pool.spec.port if args.port is None else args.port
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(server.run(args.host, port))
