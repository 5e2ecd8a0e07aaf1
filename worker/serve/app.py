"""The InferencePool data plane: one pool's model, batched by ParallelInference, behind the Open Inference
Protocol (v2) over HTTP and gRPC, on this machine.

    tandem serve examples/digits-pool.yaml --port 8000 --grpc-port 8001 --checkpoint runs/digits-train/checkpoints

InferenceServer puts the pieces together on one event loop and owns their lifecycle (start, readiness, drain,
stop, the `tandem serve` process); each piece owns its state:

    http.py          the HTTP/1.1 layer: an asyncio protocol over httptools, on uvloop
    native.py        with httpFront native, a C front that owns both ports' connections from start to stop and
                     serves the common inference request itself once the model is loaded (_front.c; HTTP/2 is
                     libnghttp2's), handing the rest to the Python servers
    routes.py        what each endpoint answers (the wire shapes: protocol.py, and triton.py for Triton's)
    grpc_service.py  the same answers over gRPC (inference.GRPCInferenceService; its wire: grpc_protocol.py),
                     whose calls grpc_server.py serves on grpcio's own server (grpc.aio) where the C front does
                     not own the gRPC port, and starts for the front where it does: one HTTP/2 implementation
                     per port for the process's whole life
    limits.py        what a client may hold of the server (sizes, streams, timeouts), defined once for all
    auth.py          the pool's bearer token, which both ask for (health and readiness excepted)
    pending.py       inference requests between submit and answer, and the sweep of their deadlines
    served_model.py  the model served: its first load, hot swaps, following a training job's checkpoints
    group.py         the pod's other server processes (processesPerReplica), which changes, swaps, statistics,
                     /metrics and readiness reach through a private channel
    inference.py     ParallelInference, the batching engine (its counters: stats.py; Prometheus: metrics.py)

The event loop only parses, validates and encodes, with numpy and orjson, and never calls torch; with the C front
(httpFront native, the default) it sees only the HTTP requests and gRPC calls the front hands it. Forwards run on
ParallelInference's worker threads, whose results come back to the loop in bursts (one wake-up for a whole
batch). Readiness turns on after the model is loaded and warmed up at every batch size in use; SIGTERM turns it
off, lets queued and running requests finish within a grace period, answers 503 to those still unanswered when
it ends (a forward still running is not waited for), and exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import signal
import socket

import torch

from tandem.api.inference import BatchingSettings, InferencePool
from tandem.worker.cores import share_cores
from tandem.worker.serve import model_loading
from tandem.worker.serve.auth import AuthTokenError, BearerToken
from tandem.worker.serve.background import BackgroundServer
from tandem.worker.serve.group import PeerRoutes, Peers
from tandem.worker.serve.grpc_server import GrpcServer
from tandem.worker.serve.grpc_service import GrpcCall, GrpcService
from tandem.worker.serve.http import HttpServer, Request
from tandem.worker.serve.limits import Limits
from tandem.worker.serve.model_loading import LoadedModel
from tandem.worker.serve.native import UNAVAILABLE, NativeFront, unavailable_reason
from tandem.worker.serve.pending import PendingRequests
from tandem.worker.serve.pool_watch import PoolWatch
from tandem.worker.serve.processes import (
    GRPC,
    HTTP,
    Group,
    HandedOver,
    Listen,
    accept_on,
    front_carries_grpc,
    listening_socket,
    receive_connections,
)
from tandem.worker.serve.routes import Routes, error_status
from tandem.worker.serve.served_model import ServedModel
from tandem.worker.serve.tasks import cancel_and_wait

log = logging.getLogger("tandem.serve")

class InferenceServer:
    """One InferencePool's model behind the Open Inference Protocol, on this machine.

    `checkpoint` (a checkpoint file, or a directory whose latest checkpoint is served) overrides the pool's
    spec.model. `auth_token_file` holds the bearer token clients must present (the pool's spec.auth Secret, mounted);
    a pool with spec.auth needs one. `watch_pool`: follow the batching settings of the pool (the manifest's name and
    namespace) in the Kubernetes API (pool_watch.py; `update_batching`). `group`: this process's place among its
    pod's server processes (group.py; None: the only one). Use `run()` for the process (`tandem serve`),
    `start()`/`drain()`/`stop()` on a running event loop, or `start_in_thread()` to embed it in a program (tests
    do). Raises ModelLoadError when the pool's model cannot be located, AuthTokenError when the token cannot be read
    or spec.auth has no token file."""

    def __init__(self, pool: InferencePool, checkpoint: str | None = None, *, grace_seconds: float = 25.0,
                 follow_interval: float = 2.0, auth_token_file: str | None = None,
                 watch_pool: bool = False, group: Group | None = None):
        spec = pool.spec
        self.pool_watch = PoolWatch(self, pool.metadata.name, pool.metadata.namespace) \
            if watch_pool and (group is None or group.leader) else None  # a group's leader changes them for all
        self.spec = spec
        self.name = spec.model.name or pool.metadata.name
        self.version = spec.model.version
        self.grace_seconds = grace_seconds
        self.ready = False
        self.draining = False
        self.port: int | None = None
        self.grpc_port: int | None = None
        if spec.auth is not None and auth_token_file is None:
            raise AuthTokenError(f"the pool's spec.auth asks for the token in Secret {spec.auth.secret_name!r}: give "
                                 "the token's file with --auth-token-file PATH")
        self.token = None if auth_token_file is None else BearerToken(auth_token_file)
        self.base_limits = Limits().with_idle_timeout(spec.idle_timeout_seconds)
        self.limits = self.base_limits  # raised for the model's full batch once it loads (_raise_limits)
        self.model = ServedModel(spec, model_loading.locate(spec.model, checkpoint), name=self.name,
                                 follow_interval=follow_interval, on_swap=self._swapped)
        self.group = group
        self.peers = None if group is None else Peers(group)
        self.model.peers = self.peers
        self._peer_routes = None if group is None else PeerRoutes(self)
        self.routes = Routes(self)
        self.pending = PendingRequests(self._answer, spec.request_timeout_ms / 1000)
        self.loading: asyncio.Task | None = None
        self._http: HttpServer | None = None
        self._grpc: GrpcServer | None = None
        self.front: NativeFront | None = None  # httpFront native where the C front can run: from start() on
        self._listeners: list[socket.socket] = []  # the HTTP and gRPC ports', when the front is asked for
        self._owns_process = False  # run() (tandem serve): process-wide tuning such as freezing the heap

    async def start(self, host: str = "127.0.0.1", port: Listen = 0, grpc_port: Listen | None = None,
                    channel: socket.socket | None = None) -> int:
        """Listen for HTTP on `port` and, unless `grpc_port` is None, for gRPC on it (0: any free port; HandedOver:
        serve the connections a process group's supervisor hands over on `channel`; the ports are in self.port and
        self.grpc_port; the HTTP port is returned), then load and warm up the model in the background
        (`self.loading`); live at once, ready once loaded."""
        self.pending.start()
        if self._peer_routes is not None:
            await self._peer_routes.start(self.group.socket_path(self.group.index))
        self._http = HttpServer(self.routes.handle, lambda: self.limits.max_body_bytes, limits=self.limits,
                                on_error=_log_crash)
        if grpc_port is not None:
            self._grpc = GrpcServer(GrpcService(self, self.token).methods(), self.limits)
        native = front_carries_grpc(self.spec.http_front, self.spec.inference_mode) and UNAVAILABLE is None
        if native:  # the C front owns both ports' connections for the process's whole life
            self.front = NativeFront(self.limits, error_status, self._grpc)
            self.front.start(self._http.adopt, self.token)
        elif self.spec.http_front == "native" and "http_front" in self.spec.model_fields_set:
            log.warning("httpFront native: %s; the Python server and grpc.aio serve every request",
                        UNAVAILABLE or "inplace mode runs each request on its caller's thread, and the front's "
                        "requests have none")
        if native and not isinstance(port, HandedOver):  # the front's connections are accepted here
            port = HandedOver(self._listen(host, port, "HTTP", self.front.adopt))
        self.port = await self._http.start(host, port)
        if grpc_port is not None:
            if native and not isinstance(grpc_port, HandedOver):
                grpc_port = HandedOver(self._listen(host, grpc_port, "gRPC", self.front.adopt_grpc))
            if not isinstance(grpc_port, HandedOver):
                self.grpc_port = await self._grpc.start(host, grpc_port)
            elif native:
                self.grpc_port = grpc_port.port
            else:
                raise OSError(f"the gRPC port's connections are handed over, and only the C front takes them: "
                              f"{UNAVAILABLE}")
        if channel is not None:
            receive_connections(channel, {HTTP: self.front.adopt if native else self._http.adopt,
                                          **({GRPC: self.front.adopt_grpc} if native and self._grpc else {})})
        self.loading = asyncio.create_task(self._load())
        if self.pool_watch is not None:
            self.pool_watch.start()
        return self.port

    def _listen(self, host: str, port: int, protocol: str, take) -> int:
        """Accept connections on host:port here, each given to `take` (the front's); the port."""
        listener = listening_socket(host, port, protocol)
        self._listeners.append(listener)
        accept_on(listener, take)
        return listener.getsockname()[1]

    async def _load(self) -> None:
        loaded = await self.model.load()
        await self._raise_limits(loaded)
        if self.front is not None:
            self._serve_front(loaded)
        self.ready = True

    async def _raise_limits(self, loaded: LoadedModel) -> None:
        """The limits raised to hold the model's full batch (limits.py), for every server of the ports."""
        self.limits = self.base_limits.for_batch(_message_limit(loaded), _body_limit(loaded))
        if self._grpc is not None:
            await self._grpc.set_limits(self.limits)
        if self.front is not None:
            self.front.configure(self.model.batching, self.limits, loaded.signature.max_batch_size)

    def _serve_front(self, loaded: LoadedModel) -> None:
        """The front, which owns the ports since start(), serves the model's common inference request from now on
        (where it can: else it keeps handing every request to the Python server)."""
        reason = unavailable_reason(loaded, self.spec.inference_mode, self.name, self.version)
        if reason is not None:
            asked = "http_front" in self.spec.model_fields_set  # not only the default
            log.log(logging.WARNING if asked else logging.INFO,
                    "httpFront native: %s; the Python server serves every request", reason)
            return
        self.front.serve(loaded, self.name, self.version, self.model.batching, self.model.inference,
                         loaded.signature.max_batch_size)
        self.model.inference.stats.fed_outcomes(self.front.counters)
        log.info("httpFront native: the C front serves JSON inference requests%s; the Python server the rest",
                 " and gRPC's ModelInfer with raw contents" if self._grpc else "")

    def _answer(self, request, context, output, error: BaseException | None) -> None:
        if request.__class__ is GrpcCall:
            request.settle(context, output, error)
        else:
            self.routes.answer(request, context, output, error)

    async def update_batching(self, settings: BatchingSettings) -> None:
        """Batch, queue and time requests out with `settings` from now on, here and in every peer; no request fails
        (those pending keep their deadlines). Raises ModelLoadError while the first model loads (or a peer does not
        answer), BatchingRefused when the model fails its warm-up at the new batch sizes: then nothing changed
        anywhere (peers that had changed change back). In a group the leader makes the change for all."""
        if self.peers is None:
            return await self.update_batching_here(settings)
        if not self.group.leader:
            return await self.peers.leader.group_batching(settings)
        async with self.peers.lock:
            previous = self.model.batching
            changes = [self.update_batching_here, *(peer.update_batching for peer in self.peers.others)]
            outcomes = await asyncio.gather(*(change(settings) for change in changes), return_exceptions=True)
            errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            if errors:
                changed = [change for change, outcome in zip(changes, outcomes, strict=True) if outcome is None]
                await asyncio.gather(*(change(previous) for change in changed), return_exceptions=True)
                raise errors[0]
        return None

    async def update_batching_here(self, settings: BatchingSettings) -> None:
        """`update_batching` in this process only."""
        await self.model.update_batching(settings)
        self.pending.set_default_timeout(settings.request_timeout_ms / 1000)
        await self._raise_limits(self.model.loaded)

    async def states(self) -> list[dict]:
        """This process's counters and readiness (Routes.local_state), then each peer's: PeerError when one does not
        answer."""
        states = [self.routes.local_state()]
        if self.peers is not None:
            for state in await self.peers.states():
                if isinstance(state, BaseException):
                    raise state
                states.append(state)
        return states

    async def group_ready(self) -> bool:
        """Ready, and so is every peer (one that does not answer is not)."""
        if not self.ready or self.peers is None:
            return self.ready
        return all(not isinstance(state, BaseException) and state["ready"] for state in await self.peers.states())

    def _swapped(self) -> None:
        if self._owns_process:
            _freeze_heap()

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
        if self.front is not None:
            self.front.drain()
        if self.pending_count:
            log.info("draining %d requests (grace period %g s)", self.pending_count, grace)
            drained = await self.pending.wait_answered(grace)
            while drained and self.front is not None and self.front.pending and loop.time() < deadline:
                await asyncio.sleep(0.01)
            drained = drained and not self.pending_count
            if not drained:
                log.warning("grace period over with %d requests unanswered: answering them 503", self.pending_count)
        await self.stop(worker_timeout=max(0.0, deadline - loop.time()),
                        why=f"grace period of {grace:g} s over")
        return drained

    async def stop(self, worker_timeout: float = 10.0, why: str = "shutting down") -> None:
        """Stop now: refuse new requests, answer every inference request not answered yet with 503 (`why` says
        why), wait up to `worker_timeout` seconds for forwards still running (a forward cannot be interrupted;
        the workers are daemon threads), close every connection."""
        self.ready = False
        self.draining = True
        await cancel_and_wait(self.loading)
        await self.model.stop_following()
        if self.pool_watch is not None:
            await self.pool_watch.stop()
        await self.pending.stop_sweep()
        for listener in self._listeners:
            asyncio.get_running_loop().remove_reader(listener)
            listener.close()
        self._listeners.clear()
        self.model.refuse_requests()
        self.pending.cut_off(why)  # their answers are written before the connections close below
        if self.front is not None:
            await self.front.stop(why)
        await self.model.wait_for_workers(worker_timeout)
        if self._grpc is not None:
            await self._grpc.close()
            self._grpc = None
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._peer_routes is not None:
            await self._peer_routes.close()
            await self.peers.close()

    async def run(self, host: str, port: Listen, grpc_port: Listen | None = None,
                  channel: socket.socket | None = None) -> int:
        """The `tandem serve` process: serve until SIGTERM or SIGINT, then drain; 0 after a drain, 1 when the
        model cannot be loaded."""
        loop = asyncio.get_running_loop()
        self._owns_process = True
        self._share_cores()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await self.start(host, port, grpc_port, channel)
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
            grpc_address = "" if self.grpc_port is None else f" and grpc://{host}:{self.grpc_port}"
            log.info("listening on http://%s:%d%s%s", host, self.port, grpc_address,
                     "; clients need the bearer token" if self.token else "")
            spec, batching = self.spec, self.model.batching
            log.info("ready: model %r version %s from %s; %s, %d worker(s), batch limit %d, queue limit %d",
                     self.name, self.version, self.model.loaded.loaded_from, spec.inference_mode,
                     spec.workers_per_replica, batching.batch_limit, batching.queue_limit)
        await stopping
        log.info("stopping: not ready; finishing requests already received")
        drained = await self.drain()
        log.info("stopped%s", "" if drained else " (some requests were cut off by the grace period)")
        return 0

    @property
    def pending_count(self) -> int:
        """Inference requests received and not answered yet (the Python server's and the front's)."""
        return self.pending.count + (0 if self.front is None else self.front.pending)

    def _share_cores(self) -> None:
        """On CPU, split the cores between the worker replicas of every process in the group (unless
        OMP_NUM_THREADS says otherwise), so that the replicas running at once do not oversubscribe the cores."""
        if not (self.spec.gpus_per_replica and torch.cuda.is_available()):
            share_cores(self.spec.workers_per_replica * (1 if self.group is None else self.group.size))

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0, ready_timeout: float = 120.0,
                        grpc_port: int | None = None) -> BackgroundServer:
        """Run the server on an event loop in a background thread; returns once it is ready (or raises the
        load error)."""
        return BackgroundServer(self, host, port, ready_timeout, grpc_port)


def _freeze_heap() -> None:
    """Move everything alive now (torch, the model, imported modules: hundreds of thousands of objects) out of
    the cyclic garbage collector's sight. Without it every full collection walks them all while requests
    allocate: measured at about a third of the event loop's time per request. Only for a process that is
    just a server (tandem serve)."""
    gc.collect()
    gc.freeze()


def _log_crash(request: Request, error: BaseException) -> None:
    log.error("unexpected error serving %s %s", request.method, request.path, exc_info=error)


def _body_limit(loaded: LoadedModel) -> int:
    """Room for a full batch as JSON (numbers up to ~24 characters) plus slack."""
    signature = loaded.signature
    elements = signature.max_batch_size * math.prod(signature.input.shape)
    return elements * 32 + (64 << 10)


def _message_limit(loaded: LoadedModel) -> int:
    """Room for a full batch in one gRPC message, request or answer (raw contents, or typed contents at up to 10
    bytes an element: an int64's varint) plus slack."""
    signature = loaded.signature
    elements = signature.max_batch_size * max(math.prod(signature.input.shape), math.prod(signature.output.shape))
    return elements * 10 + (64 << 10)
