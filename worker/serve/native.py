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

The gRPC port's connections are the front's too (HTTP/2 and HPACK in C, `_front_grpc.c`): ModelInfer for the served
model with one FP32 input in raw_input_contents, as tritonclient.grpc sends it, is queued and answered there; every
other call goes whole (headers and body) to grpc_server.py's GrpcServer, which answers it as it answers calls on its
own connections, and the front writes the answer (`calls`, `answer_call`).

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

from tandem.worker.serve.errors import ModelError
from tandem.worker.serve.grpc_server import UNSUPPORTED_MEDIA

if TYPE_CHECKING:
    from tandem.worker.serve.grpc_server import GrpcServer
    from tandem.worker.serve.inference import ParallelInference
    from tandem.worker.serve.model_loading import LoadedModel


try:
    from tandem.worker.serve._front import Front
except ImportError as error:  # not built here: the package's C extension is optional
    Front = None
    UNAVAILABLE = f"the C front was not built with this installation ({error})"
else:
    UNAVAILABLE = None

TOKEN_REFRESH_S = 1.0
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
        if call is None:
            answer(None, None, UNSUPPORTED_MEDIA)
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
    """The front of one server process: `_front.Front`, its I/O thread, and the thread that wakes ParallelInference's
    workers when the queue holds what they wait for. `adopt` gives it a connection; connections it hands back go to
    `hand_back(socket, data)` on the event loop."""

    def __init__(self, loaded: LoadedModel, name: str, version: str, batching, max_body: int, idle_timeout: float,
                 status_of, max_message: int):
        signature = loaded.signature
        self.key = (tuple(signature.input.shape), np.dtype(np.float32))
        self.status_of = status_of
        self.front = Front(model=name, version=version, input_name=signature.input.name,
                           example_shape=signature.input.shape, output_name=signature.output.name,
                           max_body=max_body, queue_limit=batching.queue_limit,
                           timeout_ms=float(batching.request_timeout_ms), idle_timeout_s=idle_timeout,
                           max_rows=signature.max_batch_size)
        self.front.configure(max_message=max_message)
        self._inference: ParallelInference | None = None
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refresh: asyncio.TimerHandle | None = None
        self._calls: CallBridge | None = None

    def start(self, inference: ParallelInference, hand_back, token=None, grpc: GrpcServer | None = None) -> None:
        """Serve: the I/O thread, the waker, connections handed back to `hand_back(socket, data)` on this loop, gRPC
        calls not the front's to `grpc` (when the server has a gRPC port), and the token (auth.BearerToken, or None)
        kept current."""
        self._inference = inference
        self._calls = None if grpc is None else CallBridge(self.front, grpc, asyncio.get_running_loop())
        self._loop = asyncio.get_running_loop()
        self._token = token
        self._refresh_token()
        inference.attach(self)
        for target, name in ((self.front.run, "tandem-http-front"), (self._wake_workers, "tandem-front-waker")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

        def handed() -> None:
            for descriptor, data in self.front.handed():
                hand_back(socket.socket(fileno=descriptor), data)
            if self._calls is not None:
                self._calls.take()

        self._loop.add_reader(self.front.handed_fd, handed)

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

    def take(self, max_rows: int, max_requests: int, oversized: bool) -> Bundle | None:
        taken = self.front.take(max_rows, max_requests, oversized)
        if taken is None:
            return None
        examples, rows, handle, arrivals = taken
        x = np.frombuffer(examples, dtype=np.float32).reshape(rows, *self.key[0])
        return Bundle(self, handle, x, rows, arrivals)

    def want(self, rows: int) -> None:
        self.front.want(rows)

    def others(self, requests: int) -> None:
        self.front.others(requests)

    # -- the server's ------------------------------------------------------------------------------------------

    def adopt(self, connection: socket.socket) -> None:
        self.front.adopt(connection.detach())

    def adopt_grpc(self, connection: socket.socket) -> None:
        self.front.adopt_grpc(connection.detach())

    def configure(self, batching, max_body: int, max_rows: int) -> None:
        self.front.configure(queue_limit=batching.queue_limit, timeout_ms=float(batching.request_timeout_ms),
                             max_body=max_body, max_rows=max_rows)

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
