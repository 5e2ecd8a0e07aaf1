"""What each endpoint of the inference server answers (KServe/Triton v2, with Triton's binary tensor, model
configuration, statistics and model repository extensions):

    GET  /v2/health/live | /v2/health/ready            200 {"live": true} / {"ready": true}; not ready: 503
    GET  /v2                                           server metadata
    GET  /v2/models/{m}[/versions/{v}]                 inputs and outputs (shapes with -1 for the batch); what
                                                       is served and how: parameters {checkpoint, source,
                                                       loaded_at, batch_limit, queue_limit, ...}
    GET  /v2/models/{m}[/versions/{v}]/ready           200 / 503, with what is served once loaded (open behind
                                                       the token, like every readiness endpoint: the operator reads it)
    POST /v2/models/{m}[/versions/{v}]/infer           JSON tensors or binary tensor data, both directions
    GET  /v2/models/{m}[/versions/{v}]/batching        the batching settings the server runs with (the pool's
                                                       batchLimit, queueLimit, maxQueueDelayMicroseconds,
                                                       requestTimeoutMs); also in the parameters of the model's
                                                       metadata and readiness. Read only: no port takes a change,
                                                       a server reads its pool's (pool_watch.py)
    GET  /v2/models/{m}[/versions/{v}]/config          Triton's model configuration (for perf_analyzer)
    GET  /v2/models[/{m}[/versions/{v}]]/stats         Triton's statistics shape
    POST /v2/repository/index
    POST /v2/repository/models/{m}/load                {"parameters": {"checkpoint": PATH}}: hot swap (403 unless
                                                       spec.modelRepository.load, and for a PATH outside its root)
    GET  /metrics                                      Prometheus

With the pool's token (spec.auth), every endpoint but health, readiness and (unless protected) /metrics answers 401
with WWW-Authenticate: Bearer to a request without it, before anything else. The gRPC service (grpc_service.py)
answers the same through the public methods here (metadata, config, stats, index, load).

Errors are {"error": "..."} naming the problem: 400 bad request, 401 no or another token, 403 a load the pool's
spec.modelRepository forbids, 404 unknown model/version/endpoint, 405
wrong method, 429 queue full (with
Retry-After), 503 loading or shutting down, 504 timed out, 500 the model's forward failed (only the request that
breaks it fails: a failing batch is retried request by request). 413 (body too large) is the HTTP layer's.

Everything here runs on the event loop and never calls torch: requests are decoded and validated with numpy and
orjson, inference requests are submitted to ParallelInference and answered when their output comes back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST

import tandem
from tandem.worker.serve import model_loading, triton
from tandem.worker.serve.auth import CHALLENGE, path_needs_token, refusal
from tandem.worker.serve.errors import InferenceTimeout, QueueFullError, ShutDownError
from tandem.worker.serve.group import PeerError
from tandem.worker.serve.http import Request
from tandem.worker.serve.metrics import OUTCOMES, exposition, merge_states
from tandem.worker.serve.model_loading import LOADS_DISABLED, LoadForbidden, ModelLoadError
from tandem.worker.serve.protocol import HEADER_LENGTH, ProtocolError, decode_request, dumps, encode_response
from tandem.worker.serve.replicas import warmup_sizes

if TYPE_CHECKING:
    from tandem.worker.serve.app import InferenceServer

EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "statistics", "parameters"]
RETRY_AFTER_SECONDS = "1"
JSON = "application/json"
_HEADER_LENGTH_KEY = HEADER_LENGTH.lower()
_MODEL_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(?:/(infer|ready|config|stats|batching))?$")
_REPOSITORY_PATH = re.compile(r"^/v2/repository/models/([^/]+)/(load|unload)$")

Reply = tuple[int, bytes, str, dict[str, str] | None]


def _json(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
    return status, dumps(value), JSON, headers


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Reply:
    return _json({"error": message}, status, headers)


class Routes:
    """The endpoints of one InferenceServer: `handle` is its HTTP handler, `answer` writes inference answers.
    Reads the server's public state (ready, draining, model, pending); counts requests by outcome for /metrics."""

    def __init__(self, server: InferenceServer):
        self.server = server
        self.name, self.version, self.spec = server.name, server.version, server.spec
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.token = server.token
        self.metrics_protected = server.spec.auth is not None and server.spec.auth.metrics == "protected"
        self._infer_paths = {  # the hot path, matched before any pattern
            f"/v2/models/{self.name}/infer": (self.name, None),
            f"/v2/models/{self.name}/versions/{self.version}/infer": (self.name, self.version),
        }
        self._fixed = {  # fixed paths; /v2/models/... and /v2/repository/models/... are matched by pattern
            "/v2/health/live": ("GET", self._live),
            "/v2/health/ready": ("GET", self._ready),
            "/v2": ("GET", self._server_metadata),
            "/v2/models/stats": ("GET", self._stats),
            "/v2/repository/index": ("POST", self._index),
            "/metrics": ("GET", self._metrics),
        }

    def handle(self, request: Request):
        """Route a request; answer it now, or return a coroutine that will (loads, and what asks the pod's other
        server processes: readiness, statistics, /metrics), or let inference answer."""
        method, path = request.method, request.path
        token = self.token
        if token is not None and path_needs_token(path, self.metrics_protected):
            authorization = request.headers.get("authorization")
            if not token.allows(authorization):
                request.respond(*_error(401, refusal(authorization), CHALLENGE))
                return None
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
                self.check_model(name, version)
                if action is None:
                    reply = self._model_metadata()
                elif action == "ready":
                    reply = self._model_ready()
                elif action == "config":
                    reply = self._config()
                elif action == "batching":
                    reply = _json(self.server.model.batching.to_dict())
                else:
                    reply = self._stats()
            elif path in self._fixed:
                wanted, handler = self._fixed[path]
                _allow(method, wanted, path)
                reply = handler()
            elif (match := _REPOSITORY_PATH.match(path)) is not None:
                _allow(method, "POST", path)
                self.check_model(match.group(1), None)
                if match.group(2) == "unload":
                    reply = self._unload()
                else:
                    return self._load(request)
            else:
                reply = _error(404, f"no endpoint {method} {path}; the inference protocol (v2) is under /v2")
        except ProtocolError as error:
            reply = _error(error.status, str(error), error.headers)
        if reply.__class__ is not tuple:
            return self._respond_later(request, reply)
        request.respond(*reply)
        return None

    async def _respond_later(self, request: Request, reply: Coroutine[Any, Any, Reply]) -> None:
        try:
            request.respond(*await reply)
        except ProtocolError as error:
            request.respond(*_error(error.status, str(error), error.headers))

    # -- health and metadata --------------------------------------------------------------------------------

    def _live(self) -> Reply:
        return _json({"live": True})

    async def _ready(self) -> Reply:
        ready = await self.server.group_ready()
        return _json({"ready": ready}, 200 if ready else 503)

    def _server_metadata(self) -> Reply:
        return _json(self.server_metadata())

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "tandem", "version": tandem.__version__, "extensions": EXTENSIONS}

    def check_model(self, name: str, version: str | None) -> None:
        if name != self.name:
            raise ProtocolError(f"unknown model {name!r}: this server serves {self.name!r}", 404)
        if version is not None and version != self.version:
            raise ProtocolError(f"model {name!r} has no version {version!r}; available: {self.version}", 404)

    def loaded(self):
        loaded = self.server.model.loaded
        if loaded is None:
            raise ProtocolError(f"model {self.name!r} is not loaded yet", 503)
        return loaded

    def signature(self):
        return self.loaded().signature

    def _model_metadata(self) -> Reply:
        return _json(self.model_metadata())

    def model_metadata(self) -> dict[str, Any]:
        """Inputs and outputs, and in `parameters` what is served and how (served_parameters)."""
        loaded = self.loaded()
        return {**loaded.signature.metadata(self.name, [self.version]), "parameters": self.served_parameters(loaded)}

    def served_parameters(self, loaded) -> dict[str, Any]:
        """What is served (checkpoint, source, loaded_at, its recorded metrics; with a promotion gate, the last
        candidate skipped) and how (the batching settings, by their snake_case names: batch_limit, queue_limit,
        max_queue_delay_microseconds, request_timeout_ms; and the pool's settings it refused, `refused_*`)."""
        model = self.server.model
        return {**loaded.parameters(), **model.promotion_parameters(), **model.batching.model_dump(),
                **model.refusal_parameters()}

    async def _model_ready(self) -> Reply:
        """Whether the model is ready (in every server process of the pod), and in `parameters` what is served (open
        behind the pool's token, like every readiness endpoint: the operator reads it to know each server's
        checkpoint)."""
        ready, loaded = await self.server.group_ready(), self.server.model.loaded
        answer = {"name": self.name, "ready": ready}
        if loaded is not None:
            answer["parameters"] = self.served_parameters(loaded)
        return _json(answer, 200 if ready else 503)

    def _config(self) -> Reply:
        return _json(self.config())

    def config(self) -> dict[str, Any]:
        """The model configuration in Triton's shape, with the batching settings the server runs with."""
        signature = self.signature()
        spec, batching = self.spec, self.server.model.batching
        kind = "KIND_GPU" if any(d.type == "cuda" for d in self.server.model.inference.devices) else "KIND_CPU"
        preferred = warmup_sizes(spec.inference_mode, batching.batch_limit) if spec.inference_mode == "batched" \
            else []
        return triton.model_config(
            signature, self.name, instances=spec.workers_per_replica, kind=kind,
            max_queue_delay_us=batching.max_queue_delay_microseconds, preferred=preferred,
            queue_limit=batching.queue_limit, timeout_us=batching.request_timeout_ms * 1000)

    async def _stats(self) -> Reply:
        return _json(await self.stats())

    async def stats(self) -> dict[str, Any]:
        """Triton's statistics extension: the served model's counters, summed over the pod's server processes (none
        before it is loaded)."""
        stats = merge_states(await self._states())["stats"]
        return {"model_stats": [] if stats is None else [triton.model_stats(self.name, self.version, stats)]}

    def _index(self) -> Reply:
        return _json(self.index())

    def index(self) -> list[dict[str, Any]]:
        """The model repository's index: the one model served, and its state."""
        server, loaded = self.server, self.server.model.loaded
        state = "READY" if server.ready else ("UNAVAILABLE" if server.draining else "LOADING")
        reason = loaded.loaded_from if loaded else ""
        return [{"name": self.name, "version": self.version, "state": state, "reason": reason}]

    async def _metrics(self) -> Reply:
        state = merge_states(await self._states())
        state |= {"model": self.name, "batching": self.server.model.batching}
        return 200, exposition(state), CONTENT_TYPE_LATEST, None

    async def _states(self) -> list[dict[str, Any]]:
        try:
            return await self.server.states()
        except PeerError as error:
            raise ProtocolError(str(error), 503, {"Retry-After": RETRY_AFTER_SECONDS}) from None

    def local_state(self) -> dict[str, Any]:
        """This process's counters and readiness (group.py's /peer/state; merge_states sums the pod's)."""
        server = self.server
        inference = server.model.inference
        outcomes = dict(self.outcomes)
        if server.front is not None:
            fed = server.front.counters()
            for outcome in ("success", "failed", "rejected"):
                outcomes[outcome] += fed[outcome]
        return {
            "outcomes": outcomes, "pending": server.pending_count, "ready": server.ready,
            "stats": None if inference is None else inference.stats.snapshot(),
            "batch_limits": sorted(server.model.batch_limits),
        }

    # -- model repository -----------------------------------------------------------------------------------

    async def _load(self, request: Request) -> None:
        try:
            reply = _json(await self.load(lambda: triton.load_request_checkpoint(request.body)))
        except ProtocolError as error:
            reply = _error(error.status, str(error))
        request.respond(*reply)

    async def load(self, requested_checkpoint: Callable[[], str | None]) -> dict[str, Any]:
        """A hot swap to `requested_checkpoint()` (read from the request only once loads are allowed; None reloads
        the current source), if the pool's spec.modelRepository allows it: ProtocolError 403 when loads are off or
        the checkpoint is outside the repository root, 400 when it cannot be loaded (the old model keeps serving)."""
        model = self.server.model
        try:
            if not self.spec.model_repository.load:
                raise LoadForbidden(LOADS_DISABLED)
            requested = requested_checkpoint()
            checkpoint = None if requested is None else \
                model_loading.repository_checkpoint(requested, model.repository_root)
            loaded = await model.swap(checkpoint, cause="load request")
        except LoadForbidden as error:
            raise ProtocolError(str(error), 403) from None
        except ModelLoadError as error:
            serving = model.loaded.loaded_from if model.loaded else "nothing yet"
            raise ProtocolError(f"model {self.name!r} not loaded: {error} (still serving {serving})") from None
        return {"name": self.name, "version": self.version, **loaded.parameters()}

    def _unload(self) -> Reply:
        return _error(400, self.unload_refusal())

    def unload_refusal(self) -> str:
        return (f"unloading is not supported: this server serves only {self.name!r}; stop the server (SIGTERM "
                "drains it) or load another checkpoint")

    # -- inference --------------------------------------------------------------------------------------

    def _infer(self, request: Request, name: str, version: str | None) -> None:
        """Validate and submit an inference request; `answer` writes its answer when the output comes back (on
        the event loop), when it times out, or never if the client goes away."""
        outcomes, server = self.outcomes, self.server
        try:
            self.check_model(name, version)
            signature = self.signature()
            inference = server.model.inference
            if server.draining or inference is None:
                why = "shutting down" if server.draining else "loading its model"
                raise ProtocolError(f"the server is {why}", 503, {"Retry-After": RETRY_AFTER_SECONDS})
            decoded = decode_request(request.body, request.headers.get(_HEADER_LENGTH_KEY), signature)
        except ProtocolError as error:
            outcomes["invalid" if error.status < 500 else "failed"] += 1
            request.respond(*_error(error.status, str(error), error.headers))
            return
        pending_requests = server.pending
        timeout = pending_requests.default_timeout
        if decoded.timeout_us is not None:
            timeout = min(timeout, decoded.timeout_us / 1e6)
        pending = pending_requests.new(request, (decoded, signature), timeout)
        try:
            pending.ticket = inference.submit(decoded.x, pending.post, timeout=timeout)
        except QueueFullError as error:
            outcomes["rejected"] += 1
            request.respond(*_error(429, str(error), {"Retry-After": RETRY_AFTER_SECONDS}))
            return
        except ShutDownError as error:
            outcomes["failed"] += 1
            request.respond(*_error(503, str(error), {"Retry-After": RETRY_AFTER_SECONDS}))
            return
        pending_requests.track(pending)

    def answer(self, request: Request, context, output: Any, error: BaseException | None) -> None:
        """Write the answer to an inference request (PendingRequests calls it once per request)."""
        if error is None:
            decoded, signature = context
            body, content_type, header_length = encode_response(output, decoded, self.name, self.version, signature)
            self.outcomes["success"] += 1
            headers = None if header_length is None else {HEADER_LENGTH: str(header_length)}
            request.respond(200, body, content_type, headers)
            return
        self.outcomes["failed"] += 1
        request.respond(*_error(error_status(error), str(error)))


def error_status(error: BaseException) -> int:
    """The HTTP status of a request that failed after it was submitted."""
    return 504 if isinstance(error, InferenceTimeout) else 503 if isinstance(error, ShutDownError) else 500


def _allow(method: str, allowed: str, path: str) -> None:
    if method != allowed:
        raise ProtocolError(f"{method} is not allowed on {path}; use {allowed}", 405, {"Allow": allowed})
