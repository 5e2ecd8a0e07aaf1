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

The event loop only parses and encodes; forwards run on ParallelInference's worker threads, whose results come
back to the loop in bursts (one wake-up for a whole batch). Readiness turns on after the model is loaded and
warmed up at every batch size in use; SIGTERM turns it off, lets queued and running requests finish within a
grace period, and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import threading
from functools import partial
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tandem.worker import model_source
from tandem.worker.inference import (
    InferenceTimeout,
    ModelError,
    ParallelInference,
    QueueFullError,
    ShutDownError,
    warmup_sizes,
)
from tandem.worker.metrics import OUTCOMES, registry_for
from tandem.worker.model_source import LoadedModel, ModelLoadError
from tandem.worker.protocol import HEADER_LENGTH, ProtocolError, decode_request, dumps, encode_response

import tandem
from tandem.api.inference import InferencePool

log = logging.getLogger("tandem.serve")

EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "statistics", "parameters"]
MAX_BODY = 256 * 1024 * 1024  # aiohttp's own cap; each model gets a tighter one from its input size
RETRY_AFTER_SECONDS = "1"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (a dependency on Linux and macOS; measured in
    bench/RESULTS.md), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _json(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(value), status=status, content_type="application/json", headers=headers)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return _json({"error": message}, status, headers)


class _Completions:
    """Hands results from worker threads to the event loop: one wake-up per burst of results, not per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Future, Any, BaseException | None]] = []

    def post(self, future: asyncio.Future, output: Any, error: BaseException | None) -> None:
        with self._lock:
            self._items.append((future, output, error))
            if len(self._items) > 1:
                return  # a delivery is already scheduled and will take this one too
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for future, output, error in items:
            if future.done():
                continue
            if error is None:
                future.set_result(output)
            else:
                future.set_exception(error)


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
        self._runner: web.AppRunner | None = None
        self._completions: _Completions | None = None
        self._idle: asyncio.Event | None = None
        self._swap_lock: asyncio.Lock | None = None
        self._tasks: list[asyncio.Task] = []
        self.loading: asyncio.Task | None = None

    # -- lifecycle --------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[_errors])
        model, version = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"
        routes = [  # aiohttp tries routes in this order: inference first
            ("POST", model + "/infer", self._infer),
            ("POST", version + "/infer", self._infer),
            ("GET", "/v2/health/live", self._live),
            ("GET", "/v2/health/ready", self._ready),
            ("GET", "/v2", self._server_metadata),
            ("GET", "/v2/models/stats", self._stats),
            ("POST", "/v2/repository/index", self._index),
            ("POST", "/v2/repository/models/{model}/load", self._load),
            ("POST", "/v2/repository/models/{model}/unload", self._unload),
            ("GET", "/metrics", self._metrics),
        ]
        for prefix in (model, version):
            routes += [
                ("GET", prefix, self._model_metadata),
                ("GET", prefix + "/ready", self._model_ready),
                ("GET", prefix + "/config", self._config),
                ("GET", prefix + "/stats", self._stats),
            ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen (port 0: any free port; returned), then load and warm up the model in the background
        (`self.loading`); live at once, ready once loaded."""
        loop = asyncio.get_running_loop()
        self._completions = _Completions(loop)
        self._idle = asyncio.Event()
        self._swap_lock = asyncio.Lock()
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True, backlog=1024)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.loading = asyncio.create_task(self._first_load())
        return self.port

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
        be answered, then stop. True when everything was answered in time."""
        self.ready = False
        self.draining = True
        grace = self.grace_seconds if grace_seconds is None else grace_seconds
        drained = True
        if self.in_flight:
            self._idle.clear()
            log.info("draining %d requests (grace period %.0f s)", self.in_flight, grace)
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except TimeoutError:
                drained = False
                log.warning("grace period over with %d requests unanswered", self.in_flight)
        await self.stop()
        return drained

    async def stop(self) -> None:
        self.ready = False
        self.draining = True
        for task in [*self._tasks, self.loading]:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self.inference is not None:
            self.inference.shutdown(drain=False, timeout=10)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def run(self, host: str, port: int) -> int:
        """The `tandem serve` process: serve until SIGTERM or SIGINT, then drain; 0 after a drain, 1 when the
        model cannot be loaded."""
        loop = asyncio.get_running_loop()
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

    async def _live(self, request: web.Request) -> web.Response:
        return _json({"live": True})

    async def _ready(self, request: web.Request) -> web.Response:
        return _json({"ready": self.ready}, 200 if self.ready else 503)

    async def _server_metadata(self, request: web.Request) -> web.Response:
        return _json({"name": "tandem", "version": tandem.__version__, "extensions": EXTENSIONS})

    def _check_model(self, request: web.Request) -> None:
        name = request.match_info["model"]
        if name != self.name:
            raise ProtocolError(f"unknown model {name!r}: this server serves {self.name!r}", 404)
        version = request.match_info.get("version")
        if version is not None and version != self.version:
            raise ProtocolError(f"model {name!r} has no version {version!r}; available: {self.version}", 404)

    def _signature(self, request: web.Request):
        self._check_model(request)
        if self.loaded is None:
            raise ProtocolError(f"model {self.name!r} is not loaded yet", 503)
        return self.loaded.signature

    async def _model_metadata(self, request: web.Request) -> web.Response:
        return _json(self._signature(request).metadata(self.name, [self.version]))

    async def _model_ready(self, request: web.Request) -> web.Response:
        self._check_model(request)
        return _json({"name": self.name, "ready": self.ready}, 200 if self.ready else 503)

    async def _config(self, request: web.Request) -> web.Response:
        signature = self._signature(request)
        spec = self.spec
        kind = "KIND_GPU" if any(d.type == "cuda" for d in self.inference.devices) else "KIND_CPU"
        preferred = warmup_sizes(spec.inference_mode, spec.batch_limit) if spec.inference_mode == "batched" else []
        return _json(signature.config(
            self.name, instances=spec.workers_per_replica, kind=kind,
            max_queue_delay_us=spec.max_queue_delay_microseconds, preferred=preferred,
            queue_limit=spec.queue_limit, timeout_us=spec.request_timeout_ms * 1000))

    async def _stats(self, request: web.Request) -> web.Response:
        if "model" in request.match_info:
            self._check_model(request)
        stats = self.inference.stats.snapshot() if self.inference is not None else None
        return _json({"model_stats": [] if stats is None else [_triton_stats(self.name, self.version, stats)]})

    async def _index(self, request: web.Request) -> web.Response:
        state = "READY" if self.ready else ("UNAVAILABLE" if self.draining else "LOADING")
        reason = self.loaded.checkpoint or self.loaded.source if self.loaded else ""
        return _json([{"name": self.name, "version": self.version, "state": state, "reason": reason or ""}])

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _metrics_state(self) -> dict[str, Any]:
        inference = self.inference
        return {
            "model": self.name, "outcomes": dict(self.outcomes), "pending": self.in_flight, "ready": self.ready,
            "stats": None if inference is None else inference.stats.snapshot(), "batch_limit": self.spec.batch_limit,
        }

    # -- model repository -----------------------------------------------------------------------------------

    async def _load(self, request: web.Request) -> web.Response:
        self._check_model(request)
        body = await request.read()
        checkpoint = _load_checkpoint_parameter(body)
        try:
            loaded = await self.swap(None if checkpoint is None else Path(checkpoint))
        except ModelLoadError as error:
            serving = self.loaded.checkpoint or self.loaded.source if self.loaded else "nothing yet"
            return _error(400, f"model {self.name!r} not loaded: {error} (still serving {serving})")
        return _json({"name": self.name, "version": self.version, "checkpoint": loaded.checkpoint,
                      "source": loaded.source})

    async def _unload(self, request: web.Request) -> web.Response:
        self._check_model(request)
        return _error(400, f"unloading is not supported: this server serves only {self.name!r}; stop the server "
                      "(SIGTERM drains it) or load another checkpoint")

    # -- inference --------------------------------------------------------------------------------------

    async def _infer(self, request: web.Request) -> web.Response:
        self.in_flight += 1
        try:
            response = await self._infer_one(request)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and self.draining:
                self._idle.set()
        return response

    async def _infer_one(self, request: web.Request) -> web.Response:
        outcomes = self.outcomes
        try:
            signature = self._signature(request)
        except ProtocolError as error:
            outcomes["invalid" if error.status < 500 else "failed"] += 1
            return _error(error.status, str(error))
        inference = self.inference
        if self.draining or inference is None:
            outcomes["failed"] += 1
            why = "shutting down" if self.draining else "loading its model"
            return _error(503, f"the server is {why}", {"Retry-After": RETRY_AFTER_SECONDS})
        try:
            length = request.content_length
            if length is not None and length > self.max_body:
                raise ProtocolError(f"request body too large: {length} bytes; the limit for this model is "
                                    f"{self.max_body} bytes", 413)
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge as error:
                raise ProtocolError(f"request body too large: over {error.max_size} bytes", 413) from None
            if len(body) > self.max_body:
                raise ProtocolError(f"request body too large: {len(body)} bytes; the limit for this model is "
                                    f"{self.max_body} bytes", 413)
            decoded = decode_request(body, request.headers.get(HEADER_LENGTH), signature)
        except ProtocolError as error:
            outcomes["invalid"] += 1
            return _error(error.status, str(error))
        timeout = self.spec.request_timeout_ms / 1000
        if decoded.timeout_us is not None:
            timeout = min(timeout, decoded.timeout_us / 1e6)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        try:
            ticket = inference.submit(decoded.x, partial(self._completions.post, future), timeout=timeout)
        except QueueFullError as error:
            outcomes["rejected"] += 1
            return _error(429, str(error), {"Retry-After": RETRY_AFTER_SECONDS})
        except ShutDownError as error:
            outcomes["failed"] += 1
            return _error(503, str(error), {"Retry-After": RETRY_AFTER_SECONDS})
        timer = loop.call_later(timeout, _expire, future, ticket, timeout)
        try:
            output = await future
        except InferenceTimeout as error:
            outcomes["failed"] += 1
            return _error(504, str(error))
        except ModelError as error:
            outcomes["failed"] += 1
            return _error(500, str(error))
        except ShutDownError as error:
            outcomes["failed"] += 1
            return _error(503, str(error))
        finally:
            timer.cancel()
            if not future.done():  # the client went away: withdraw the request if it is still queued
                ticket.cancel()
        body, content_type, header_length = encode_response(output, decoded, self.name, self.version, signature)
        outcomes["success"] += 1
        response = web.Response(body=body, content_type=content_type)
        if header_length is not None:
            response.headers[HEADER_LENGTH] = str(header_length)
        return response


def _expire(future: asyncio.Future, ticket, timeout: float) -> None:
    if not future.done():
        ticket.cancel()
        future.set_exception(InferenceTimeout(f"no output within the request's timeout of {timeout * 1000:.0f} ms"))


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


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error as {"error": "..."}: protocol errors with their status, aiohttp's own (405, 413) as JSON,
    anything unexpected as a logged 500 that names the exception."""
    try:
        return await handler(request)
    except ProtocolError as error:
        return _error(error.status, str(error))
    except web.HTTPRequestEntityTooLarge as error:
        return _error(413, f"request body too large: {error.actual_size} bytes; the limit is {error.max_size} bytes")
    except web.HTTPNotFound:
        return _error(404, f"no endpoint {request.method} {request.path}; the inference protocol (v2) is under /v2")
    except web.HTTPMethodNotAllowed as error:
        allowed = ", ".join(sorted(error.allowed_methods))
        return _error(405, f"{request.method} is not allowed on {request.path}; use {allowed}", {"Allow": allowed})
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _error(error.status, error.reason)
    except asyncio.CancelledError:
        raise
    except Exception as error:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return _error(500, f"internal error: {type(error).__name__}: {error}")


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
