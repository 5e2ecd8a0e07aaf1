"""The front in C: the common inference request served with no Python per request (`httpFront: native`), over HTTP
and over gRPC.

On a CPU-bound server every microsecond the interpreter spends per request comes out of the model's forwards: the
Python HTTP layer and the request's validation cost 45-60 us of the event loop per request under wrk, a C request
path 19-29 (bench/RESULTS.md). The front (`_front.c`) owns the HTTP port's connections on a thread of its own; the
Open Inference Protocol's JSON infer request for the served model, its input a flat FP32 list of the model's example
shape, is parsed there into a queue that ParallelInference's workers take from as part of their batches
(ParallelInference.attach), and answered there. Every other request, and any the front is not sure of, is served
by the Python server as before: the front hands the connection over with the bytes it has read (`handed`), so the
Python server stays the one place where requests are validated and errors explained.

The gRPC port's connections are the front's too, from the server's start to its stop (HTTP/2 is libnghttp2's,
`_front_grpc.c`): ModelInfer for the served model with one FP32 input in raw_input_contents, as tritonclient.grpc
sends it, is queued and answered there once the model is served; every other call, and every call before then, goes
whole (headers and body) to grpc_server.py's GrpcServer (`start_call`), whose outcome the front writes (`calls`,
`answer_call`). So one HTTP/2 implementation serves the gRPC port for the process's whole life. Every limit the
front applies is limits.py's, given to it (`Limits.for_front`).

What the front answers itself, as the Python server would: the outputs (200), a full queue (429, queueLimit counted
over the front's queue), a request past requestTimeoutMs (504), the server draining or stopped (503), a failed
forward (its status and message); over gRPC the same as status codes (RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, also
at the client's grpc-timeout, UNAVAILABLE, ...). Its counts join the server's statistics and /metrics. A model whose
input or output is not FP32 is served by the Python server alone (the log says so).
"""

from __future__ import annotations

import asyncio
import functools
import re
import socket
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from tandem.worker.serve.errors import ModelError, queue_full_message
from tandem.worker.serve.grpc_protocol import status_code

if TYPE_CHECKING:
    from tandem.worker.serve.grpc_server import GrpcServer
    from tandem.worker.serve.inference import ParallelInference
    from tandem.worker.serve.limits import Limits
    from tandem.worker.serve.model_loading import LoadedModel


try:
    from tandem.worker.serve._front import Front
except ImportError as error:  # not built here: the package's C extension is optional
    Front = None
    UNAVAILABLE = f"the C front was not built with this installation ({error})"
else:
    UNAVAILABLE = None

TOKEN_REFRESH_S = 1.0
UNIMPLEMENTED = 12  # grpc.StatusCode.UNIMPLEMENTED's number
PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
"""Names the front matches in requests and writes in answers as they are (no JSON or URL escapes needed)."""


def unavailable_reason(loaded: LoadedModel, mode: str, name: str, version: str) -> str | None:
    """Why the front cannot serve `loaded`'s requests as model `name` `version` in inference mode `mode` (None: it
    can)."""
    if UNAVAILABLE is not None:
        return UNAVAILABLE
    if mode == "inplace":
        return "inplace mode runs each request on its caller's thread, and the front's requests have none"
    signature = loaded.signature
    for what, value in (("model name", name), ("version", version), ("input name", signature.input.name),
                        ("output name", signature.output.name)):
        if not PLAIN_NAME.fullmatch(value):
            return f"the {what} {value!r} is not only letters, digits, '.', '_' and '-', as the front writes it"
    if signature.input.datatype != "FP32" or signature.output.datatype != "FP32":
        return (f"the model takes {signature.input.datatype} and returns {signature.output.datatype}; the C front "
                "serves FP32 in and out")
    return None


class Bundle:
    """Requests the front queued, taken as one item of a batch (the Feed's lot): their examples, and where their
    outputs go."""

    __slots__ = ("front", "handle", "x", "rows", "key", "submitted", "arrivals", "deadline")

    def __init__(self, front: NativeFront, handle: int, x: np.ndarray, rows: int, arrivals: list[int]):
        self.front = front
        self.handle = handle
        self.x = x
        self.rows = rows
        self.key = front.key
        self.arrivals = arrivals
        self.submitted = arrivals[0]
        self.deadline = None  # the front answers its requests' deadlines itself

    def split(self) -> list[Bundle]:
        """One bundle per request, in order (a failed forward is retried one request at a time)."""
        if len(self.arrivals) == 1:
            return [self]
        parts, offset = [], 0
        for (handle, rows), arrival in zip(self.front.front.split(self.handle), self.arrivals, strict=True):
            parts.append(Bundle(self.front, handle, self.x[offset:offset + rows], rows, [arrival]))
            offset += rows
        return parts

    def finish(self, output: Any, error: BaseException | None) -> None:
        self.x = None
        front = self.front.front
        if error is None:
            try:
                out = np.ascontiguousarray(output, dtype=np.float32)
                front.give(self.handle, out, out.shape[1:])
                return
            except (TypeError, ValueError) as failure:  # the model's output does not fit the answer
                error = ModelError(f"the model's output cannot be answered: {failure}")
        front.fail(self.handle, self.front.status_of(error), str(error))


class CallBridge:
    """The gRPC calls a front leaves to the Python server: each started on `grpc` (GrpcServer) as it starts calls on
    its own connections, its answer given back to the front to write; a call the front says is cancelled (its client
    reset it, or left) is cancelled here too, as on GrpcServer's own connections."""

    def __init__(self, front, grpc: GrpcServer, loop: asyncio.AbstractEventLoop):
        self.front = front
        self.grpc = grpc
        self.loop = loop
        self._running: dict[tuple[int, int], asyncio.Future] = {}

    def take(self) -> None:
        """Start the calls the front has handed over, cancel those it says are cancelled (on the event loop)."""
        for serial, stream, headers, body in self.front.calls():
            if headers is None:
                running = self._running.pop((serial, stream), None)
                if running is not None:
                    running.cancel()
            else:
                self._start(serial, stream, headers, body)

    def _start(self, serial: int, stream: int, headers: dict[str, str], body: bytes) -> None:
        answer = functools.partial(self.front.answer_call, serial, stream)
        try:
            call = self.grpc.start_call(headers, body, self.loop)
        except Exception as error:
            answer(*self.grpc.outcome(None, error))
            return
        if call is None:  # not gRPC's content-type: the front answers those 415 itself, so only a defect comes here
            answer(UNIMPLEMENTED, "not a gRPC request (its content-type is not application/grpc)", None)
            return
        if not isinstance(call, asyncio.Future):
            call = self.loop.create_task(call)
        key = (serial, stream)
        self._running[key] = call

        def settled(done: asyncio.Future) -> None:
            if self._running.get(key) is done:
                del self._running[key]
            if not done.cancelled():
                error = done.exception()
                answer(*self.grpc.outcome(None if error else done.result(), error))

        call.add_done_callback(settled)

    def cancel_all(self) -> None:
        running, self._running = self._running, {}
        for call in running.values():
            call.cancel()


class NativeFront:
    """The front of one server process: `_front.Front`, its I/O thread, and, once it serves a model, the thread that
    wakes ParallelInference's workers when the queue holds what they wait for.

    Its life, on the server's event loop:

        front = NativeFront(limits, status_of, grpc)   # limits.Limits; status_of(error) -> HTTP status;
                                                       # grpc: grpc_server.GrpcServer, or None without a gRPC port
        front.start(hand_back, token)                  # the I/O thread runs: the ports' connections can be adopted;
                                                       # HTTP connections it does not serve go to
                                                       # hand_back(socket, data) on this loop, gRPC calls to grpc
                                                       # (start_call, outcome); token: auth.BearerToken or None
        front.adopt(sock) / front.adopt_grpc(sock)     # a connection accepted on the HTTP / gRPC port (ours now)
        front.serve(loaded, name, version, batching, inference, max_rows)
                                                       # the model loaded: the front serves its inference requests
                                                       # (ParallelInference `inference` takes them: attach)
        front.configure(batching, limits, max_rows)    # new batching settings, or limits (raised for a full batch)
        front.drain(); await front.stop(why)

    Before serve() it carries the transport only: every HTTP request is handed to the Python server, every gRPC call
    to `grpc`. The Feed (ParallelInference's): queued, take, want, others; its counters: counters(), pending."""

    def __init__(self, limits: Limits, status_of, grpc: GrpcServer | None = None):
        self.front = Front(**limits.for_front())
        self.front.configure(grpc_codes=bytes(status_code(http).value[0] for http in range(400, 600)))
        self.status_of = status_of
        self.grpc = grpc
        self.key = None
        self._inference: ParallelInference | None = None
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refresh: asyncio.TimerHandle | None = None
        self._calls: CallBridge | None = None
        self._token = None

    def start(self, hand_back, token=None) -> None:
        """Serve (on the running event loop): the I/O thread, connections handed back to `hand_back(socket, data)`
        on this loop, gRPC calls not the front's to the GrpcServer given, and the token (auth.BearerToken, or None)
        kept current."""
        self._loop = asyncio.get_running_loop()
        self._calls = None if self.grpc is None else CallBridge(self.front, self.grpc, self._loop)
        self._token = token
        self._refresh_token()
        self._thread(self.front.run, "tandem-front")

        def handed() -> None:
            for descriptor, data in self.front.handed():
                hand_back(socket.socket(fileno=descriptor), data)
            if self._calls is not None:
                self._calls.take()

        self._loop.add_reader(self.front.handed_fd, handed)

    def serve(self, loaded: LoadedModel, name: str, version: str, batching, inference: ParallelInference,
              max_rows: int) -> None:
        """Serve `loaded`'s common inference request as model `name` `version` from now on, its requests batched by
        `inference` (attached here) under `batching` (queue_limit, request_timeout_ms), `max_rows` examples a request
        at most."""
        signature = loaded.signature
        self.key = (tuple(signature.input.shape), np.dtype(np.float32))
        self.front.serve_model(model=name, version=version, input_name=signature.input.name,
                               example_shape=signature.input.shape, output_name=signature.output.name,
                               max_rows=max_rows, queue_limit=batching.queue_limit,
                               timeout_ms=float(batching.request_timeout_ms))
        self.front.configure(queue_full=queue_full_message(batching.queue_limit))
        self._inference = inference
        inference.attach(self)
        self._thread(self._wake_workers, "tandem-front-waker")

    def _thread(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _refresh_token(self) -> None:
        """The front holds the token the Secret's file holds now, with the file's stamp: it takes a request only
        while the file keeps that stamp (a stat per request) and the request carries that token, and leaves every
        other to the Python server, which reads the file again. So a rotated token is refused at once, and the
        front serves the new one within TOKEN_REFRESH_S."""
        if self._token is None:
            return
        token, stamp = self._token.current()
        self.front.configure(token=token, token_path=str(self._token.path), token_stamp=stamp)
        self._refresh = self._loop.call_later(TOKEN_REFRESH_S, self._refresh_token)

    def _wake_workers(self) -> None:
        while self.front.wait_wanted():
            self._inference.wake()

    # -- ParallelInference's Feed ------------------------------------------------------------------------------

    def queued(self) -> tuple[int, int, int]:
        return self.front.queued()

    def take(self, max_rows: int, max_requests: int, key: tuple | None) -> tuple[list[Bundle], list]:
        taken = None if key not in (None, self.key) else self.front.take(max_rows, max_requests, key is None)
        if taken is None:
            return [], []  # (the front answers its own requests past their deadline)
        examples, rows, handle, arrivals = taken
        x = np.frombuffer(examples, dtype=np.float32).reshape(rows, *self.key[0])
        return [Bundle(self, handle, x, rows, arrivals)], []

    def want(self, rows: int) -> None:
        self.front.want(rows)

    def others(self, requests: int) -> None:
        self.front.others(requests)

    # -- the server's ------------------------------------------------------------------------------------------

    def adopt(self, connection: socket.socket) -> None:
        self.front.adopt(connection.detach())

    def adopt_grpc(self, connection: socket.socket) -> None:
        self.front.adopt_grpc(connection.detach())

    def configure(self, batching, limits: Limits | None = None, max_rows: int | None = None) -> None:
        """New batching settings (queue_limit, request_timeout_ms), limits and examples a request at most (None:
        kept)."""
        self.front.configure(queue_limit=batching.queue_limit, timeout_ms=float(batching.request_timeout_ms),
                             queue_full=queue_full_message(batching.queue_limit),
                             **({} if max_rows is None else {"max_rows": max_rows}),
                             **({} if limits is None else limits.for_front()))

    def counters(self) -> dict[str, int]:
        return self.front.counters()

    @property
    def pending(self) -> int:
        return self.front.counters()["pending"]

    def drain(self) -> None:
        self.front.drain()

    async def stop(self, why: str) -> None:
        """Answer what is not answered 503 (`why`), close every connection, end the threads."""
        if self._loop is not None:
            self._loop.remove_reader(self.front.handed_fd)
        if self._refresh is not None:
            self._refresh.cancel()
        if self._calls is not None:
            self._calls.cancel_all()
        self.front.stop(f"the server stopped before this request was answered ({why})")
        for thread in self._threads:
            await asyncio.to_thread(thread.join)
