"""The gRPC server (worker/serve/grpc_server.py) on a real socket on 127.0.0.1, with small methods of its own and
grpcio's client: flow control both ways, the message size limit, refusals, metadata and deadlines, cancellation,
a client that does not speak HTTP/2, breaches of HTTP/2 and seeded random frames, the limit on a connection's calls,
back-pressure on a client that does not read, and a graceful close. Calls are held at a known point with events,
never with sleeps.

Each test that serves over a socket runs twice: on GrpcServer's own connections, then on the C front's (`_front`,
HTTP/2 and HPACK in C), which hands every call it does not serve itself (all of these: none is an inference request
for its model) to the same GrpcServer (native.CallBridge) and writes the answers."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from serving import skip_without_c_front, wait_until
from tritonclient.grpc import service_pb2

from tandem.worker.serve.grpc_server import (
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_FRAME,
    MAX_STREAMS,
    PING,
    PREFACE,
    PRIORITY,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    WINDOW_UPDATE,
    CallContext,
    GrpcError,
    GrpcServer,
    _Connection,
    frame,
    header_field,
)
from tandem.worker.serve.http import new_event_loop
from tandem.worker.serve.native import CallBridge, Front
from tandem.worker.serve.processes import accept_on, listening_socket

WAIT_S = 30
LIMIT = 8 << 20
INFER = "/inference.GRPCInferenceService/ModelInfer"
LIVE = "/inference.GRPCInferenceService/ServerLive"


class Loop:
    """An event loop (uvloop, as `tandem serve` runs) on a thread of its own, and the servers started on it: on their
    own connections, or (`native`) behind a C front that owns the connections."""

    def __init__(self, native: bool):
        self.native = native
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[GrpcServer] = []
        self.fronts: list[tuple[Front, threading.Thread, socket.socket, CallBridge]] = []

    def run(self, coroutine, timeout: float = WAIT_S):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def serve(self, methods, max_message: int = LIMIT) -> tuple[GrpcServer, str]:
        server = GrpcServer(methods, max_message)
        if self.native:
            port = self.run(self._front(server, max_message))
        else:
            port = self.run(server.start("127.0.0.1", 0))
            self.servers.append(server)
        return server, f"127.0.0.1:{port}"

    async def _front(self, server: GrpcServer, max_message: int) -> int:
        """A front for a model no call here names, so that it hands every call to `server`."""
        front = Front(model="front-only", version="1", input_name="input", example_shape=[4], output_name="output",
                      max_body=1 << 20, queue_limit=8, timeout_ms=60_000.0, idle_timeout_s=60.0, max_rows=8)
        front.configure(max_message=max_message)
        thread = threading.Thread(target=front.run, daemon=True)
        thread.start()
        bridge = CallBridge(front, server, asyncio.get_running_loop())
        listener = listening_socket("127.0.0.1", 0, "gRPC")
        accept_on(listener, lambda connection: front.adopt_grpc(connection.detach()))
        self.loop.add_reader(front.handed_fd, lambda: (front.handed(), bridge.take()))
        self.fronts.append((front, thread, listener, bridge))
        return listener.getsockname()[1]

    async def _stop_fronts(self) -> None:
        for front, thread, listener, bridge in self.fronts:
            self.loop.remove_reader(listener)
            listener.close()
            self.loop.remove_reader(front.handed_fd)
            bridge.cancel_all()
            front.stop("the test is over")
            await asyncio.to_thread(thread.join, WAIT_S)

    def close(self) -> None:
        for server in self.servers:
            self.run(server.close(0))
        self.run(self._stop_fronts())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)
        self.loop.close()


@pytest.fixture(params=["python", "native"])
def loop(request) -> Iterator[Loop]:
    skip_without_c_front(request.param)
    running = Loop(native=request.param == "native")
    yield running
    running.close()


async def echo(request: service_pb2.ModelInferRequest, context: CallContext) -> service_pb2.ModelInferResponse:
    """Each raw input back, `id` times over (id "" once), and what the call's context holds in the model's name."""
    times = int(request.id or 1)
    remaining = context.time_remaining()
    # grpc-core rounds a timeout of 10 s or more up to its next 100 ms on the wire (up to 10.1 s seen from here)
    deadline = "none" if remaining is None else "within 10 s" if 0 < remaining <= 10.2 else f"{remaining}"
    return service_pb2.ModelInferResponse(
        model_name=f"{context.metadata('authorization')} / {deadline}",
        raw_output_contents=[raw * times for raw in request.raw_input_contents])


async def live(request, context) -> service_pb2.ServerLiveResponse:
    return service_pb2.ServerLiveResponse(live=True)


METHODS = {INFER: (service_pb2.ModelInferRequest, echo), LIVE: (service_pb2.ServerLiveRequest, live)}


def channel(address: str, own_connection: bool = False) -> grpc.Channel:
    """A client channel; grpcio shares one connection among channels to the same address unless `own_connection`."""
    return grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                   ("grpc.max_send_message_length", 64 << 20),
                                                   ("grpc.use_local_subchannel_pool", int(own_connection))])


def infer(chan: grpc.Channel, path: str = INFER, **call) -> grpc.UnaryUnaryMultiCallable:
    return chan.unary_unary(path, request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                            response_deserializer=service_pb2.ModelInferResponse.FromString)


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def test_messages_many_windows_long_cross_flow_control_both_ways_on_concurrent_calls(loop):
    """3 MiB requests and 6 MiB answers, eight at once on one connection: hundreds of frames each way, answers
    held by the client's windows (64 KiB at first) until it opens them."""
    _, address = loop.serve(METHODS)
    with channel(address) as chan, ThreadPoolExecutor(8) as pool:
        call = infer(chan)
        payloads = [bytes([n]) * (3 << 20) for n in range(8)]
        futures = [pool.submit(call, service_pb2.ModelInferRequest(id="2", raw_input_contents=[payload]),
                               timeout=WAIT_S) for payload in payloads]
        for payload, future in zip(payloads, futures, strict=True):
            assert future.result().raw_output_contents == [payload * 2]


def test_metadata_and_the_clients_deadline_reach_the_handler(loop):
    _, address = loop.serve(METHODS)
    with channel(address) as chan:
        answer = infer(chan)(service_pb2.ModelInferRequest(), metadata=[("authorization", "Bearer x")], timeout=10)
        assert answer.model_name == "Bearer x / within 10 s"
        assert infer(chan)(service_pb2.ModelInferRequest()).model_name == "None / none"


def test_a_request_over_the_limit_is_resource_exhausted_and_the_connection_serves_on(loop):
    _, address = loop.serve(METHODS, max_message=1 << 20)
    with channel(address) as chan:
        too_big = service_pb2.ModelInferRequest(raw_input_contents=[b"x" * (2 << 20)])
        refused = refusal(lambda: infer(chan)(too_big, timeout=WAIT_S))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than the server's limit of 1048576 bytes" in refused.details()
        answer_too_big = service_pb2.ModelInferRequest(id="3", raw_input_contents=[b"x" * (512 << 10)])
        refused = refusal(lambda: infer(chan)(answer_too_big, timeout=WAIT_S))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "the answer of" in refused.details()
        fits = service_pb2.ModelInferRequest(raw_input_contents=[b"y" * (512 << 10)])
        assert infer(chan)(fits, timeout=WAIT_S).raw_output_contents == [b"y" * (512 << 10)]


async def fail(request, context):
    if request.id == "grpc":
        raise GrpcError(grpc.StatusCode.FAILED_PRECONDITION, "na\u00efve: 100% refused\non two lines")
    raise KeyError("a defect")


def test_refusals_have_their_codes_and_messages_and_the_server_lives_on(loop):
    _, address = loop.serve({**METHODS, "/t/Fail": (service_pb2.ModelInferRequest, fail)})
    with channel(address) as chan:
        unknown = refusal(lambda: infer(chan, "/inference.GRPCInferenceService/ModelStreamInfer")(
            service_pb2.ModelInferRequest(), timeout=WAIT_S))
        assert unknown.code() == grpc.StatusCode.UNIMPLEMENTED and "ModelStreamInfer" in unknown.details()
        failed = refusal(lambda: infer(chan, "/t/Fail")(service_pb2.ModelInferRequest(id="grpc"), timeout=WAIT_S))
        assert (failed.code(), failed.details()) == (grpc.StatusCode.FAILED_PRECONDITION,
                                                     "na\u00efve: 100% refused\non two lines")
        defect = refusal(lambda: infer(chan, "/t/Fail")(service_pb2.ModelInferRequest(), timeout=WAIT_S))
        assert defect.code() == grpc.StatusCode.INTERNAL and "KeyError" in defect.details()
        for compression in (grpc.Compression.Gzip, grpc.Compression.Deflate):
            compressed = infer(chan)(service_pb2.ModelInferRequest(raw_input_contents=[b"a" * 10_000]),
                                     timeout=WAIT_S, compression=compression)
            assert compressed.raw_output_contents == [b"a" * 10_000]
        not_protobuf = chan.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        garbage = refusal(lambda: not_protobuf(b"\xff\xff\xff", timeout=WAIT_S))
        assert garbage.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid inference.ModelInferRequest" in garbage.details()
        assert infer(chan)(service_pb2.ModelInferRequest(raw_input_contents=[b"ok"])).raw_output_contents == [b"ok"]


def test_a_client_that_does_not_speak_http2_is_closed_with_goaway_and_others_are_served(loop):
    _, address = loop.serve(METHODS)
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while chunk := raw.recv(65536):
            received += chunk
    error, debug = _goaway(received)
    assert (error, b"not HTTP/2's client preface" in debug) == (PROTOCOL_ERROR, True), debug
    with channel(address) as chan:
        assert infer(chan)(service_pb2.ModelInferRequest(raw_input_contents=[b"ok"])).raw_output_contents == [b"ok"]


def _frames(received: bytes) -> list[tuple[int, int, bytes]]:
    """The whole frames received: (kind, stream, payload)."""
    frames, offset = [], 0
    while offset + 9 <= len(received):
        length = int.from_bytes(received[offset:offset + 3], "big")
        if offset + 9 + length > len(received):
            break
        stream = int.from_bytes(received[offset + 5:offset + 9], "big")
        frames.append((received[offset + 3], stream, received[offset + 9:offset + 9 + length]))
        offset += 9 + length
    return frames


def _goaway(received: bytes) -> tuple[int, bytes]:
    """The error code and debug data of the GOAWAY frame among the frames received (after the server's SETTINGS)."""
    for kind, _, payload in _frames(received):
        if kind == GOAWAY:
            return int.from_bytes(payload[4:8], "big"), payload[8:]
    raise AssertionError(f"no GOAWAY in {received!r}")


@pytest.mark.parametrize(("frames", "code", "words"), [
    (frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\xff\xff\xff\xff\xff"), COMPRESSION_ERROR, b"HPACK cannot decode"),
    (frame(DATA, 0, 1, b"x" * (MAX_FRAME + 1)), FRAME_SIZE_ERROR, b"a frame of 16385 bytes"),
    (frame(HEADERS, END_HEADERS, 2, b""), PROTOCOL_ERROR, b"HEADERS on stream 2"),
    (frame(HEADERS, 0, 1, header_field(b":path", b"/x")) + frame(PING, 0, 0, b"\0" * 8), PROTOCOL_ERROR,
     b"interrupted before END_HEADERS"),
    (frame(HEADERS, 0, 1, b"\0" * 16_000) + frame(CONTINUATION, 0, 1, b"\0" * 16_000) * 4, ENHANCE_YOUR_CALM,
     b"a header block of over 65536 bytes"),
], ids=["hpack", "frame-size", "even-stream", "interrupted-block", "continuation-flood"])
def test_a_breach_of_http2_ends_that_connection_with_goaway_naming_it(loop, frames, code, words):
    _, address = loop.serve(METHODS)
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as raw:
        raw.sendall(PREFACE + frame(SETTINGS, 0, 0, b"") + frames)
        received = b""
        while chunk := raw.recv(65536):
            received += chunk
    error, debug = _goaway(received)
    assert (error, words in debug) == (code, True), debug
    with channel(address) as chan:
        assert infer(chan)(service_pb2.ModelInferRequest(raw_input_contents=[b"ok"])).raw_output_contents == [b"ok"]


def test_streams_past_the_announced_limit_are_refused_and_the_open_ones_served(loop):
    _, address = loop.serve(METHODS)
    host, port = address.split(":")
    headers = header_field(b":method", b"POST") + header_field(b":path", INFER.encode()) + \
        header_field(b"content-type", b"application/grpc")
    opened = [1 + 2 * n for n in range(MAX_STREAMS + 1)]  # one past the limit, none ended
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as raw:
        raw.sendall(PREFACE + frame(SETTINGS, 0, 0, b"") +
                    b"".join(frame(HEADERS, END_HEADERS, stream, headers) for stream in opened))
        received = b""
        while not any(kind == RST_STREAM for kind, _, _ in _frames(received)):
            received += raw.recv(65536)
        request = service_pb2.ModelInferRequest(raw_input_contents=[b"first"]).SerializeToString()
        raw.sendall(frame(DATA, END_STREAM, opened[0], b"\0" + len(request).to_bytes(4, "big") + request))
        while not any(kind == HEADERS and stream == opened[0] for kind, stream, _ in _frames(received)):
            received += raw.recv(65536)
    frames = _frames(received)
    settings = frames[0][2]
    announced = {int.from_bytes(settings[i:i + 2], "big"): int.from_bytes(settings[i + 2:i + 6], "big")
                 for i in range(0, len(settings), 6)}
    assert announced[SETTINGS_MAX_CONCURRENT_STREAMS] == MAX_STREAMS
    resets = [(stream, int.from_bytes(payload, "big")) for kind, stream, payload in frames if kind == RST_STREAM]
    assert resets == [(opened[-1], REFUSED_STREAM)]
    answer = b"".join(payload for kind, stream, payload in frames if kind == DATA and stream == opened[0])
    assert service_pb2.ModelInferResponse.FromString(answer[5:]).raw_output_contents == [b"first"]


def test_a_client_that_sends_pings_without_reading_is_read_no_further_until_it_reads(loop):
    """A PING flood (each owed an acknowledgement) from a client that never reads: the server stops reading it once
    its answers back up, so they stay bounded; once the client reads, the connection carries on."""
    server, address = loop.serve(METHODS)
    host, port = address.split(":")
    flood = frame(PING, 0, 0, b"\0" * 8) * 65_536  # 1 MiB of PINGs per send, 1 MiB of acknowledgements owed
    with socket.socket() as raw:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # before connecting: a small window
        raw.settimeout(WAIT_S)
        raw.connect((host, int(port)))
        raw.sendall(PREFACE + frame(SETTINGS, 0, 0, b""))
        sender = threading.Thread(target=lambda: [raw.sendall(flood) for _ in range(8)], daemon=True)
        sender.start()
        if not loop.native:  # the front's connection is not a Python object to look into: the reads below tell
            wait_until(lambda: server._connections, what="the connection accepted")
            (connection,) = server._connections
            wait_until(lambda: not connection.transport.is_reading(), what="the server pausing its reads")
            assert connection.transport.get_write_buffer_size() < 1 << 20  # 8 MiB of acknowledgements were asked for
        received = 0
        while sender.is_alive() or received < 8 * len(flood):
            chunk = raw.recv(1 << 20)
            assert chunk, "the server closed the connection"
            received += len(chunk)
        sender.join(WAIT_S)
    with channel(address) as chan:
        assert infer(chan)(service_pb2.ModelInferRequest(raw_input_contents=[b"ok"])).raw_output_contents == [b"ok"]


FIXED_SIZES = {PRIORITY: 5, RST_STREAM: 4, PING: 8, WINDOW_UPDATE: 4}


def _random_frames(rng: random.Random) -> bytes:
    """A few frames of any kind, mostly well formed (the sizes their kinds have, header blocks HPACK decodes, gRPC
    messages), with flags, streams and contents drawn at random, some cut short: so that the paths past the first
    checks are taken too."""
    call = service_pb2.ModelInferRequest(raw_input_contents=[b"x"]).SerializeToString()
    frames = b""
    for _ in range(rng.randint(1, 8)):
        kind = rng.randrange(11)
        stream = rng.choice([0, 1, 1, 3, 3, 5, 2, rng.randrange(1 << 31)])
        flags = rng.choice([0, END_STREAM, END_HEADERS, END_HEADERS | END_STREAM, rng.randrange(256)])
        well_formed = rng.random() < 0.8
        if kind in (HEADERS, CONTINUATION) and well_formed:
            payload = header_field(b":path", rng.choice([INFER, LIVE, "/x"]).encode()) + \
                header_field(b"content-type", b"application/grpc") + \
                rng.choice([b"", header_field(b"grpc-timeout", rng.choice([b"1S", b"x", b"99999999H"]))])
        elif kind == DATA and well_formed:
            payload = rng.choice([b"\0", b"\1", b"\2"]) + len(call).to_bytes(4, "big") + call
        elif kind == SETTINGS and well_formed:
            payload = b"".join(rng.choice([0x1, 0x3, 0x4, 0x5, 0x6, 0x99]).to_bytes(2, "big") +
                               rng.choice([0, 1, 16384, 1 << 20, (1 << 31) - 1, (1 << 32) - 1]).to_bytes(4, "big")
                               for _ in range(rng.randrange(3)))
        elif kind in FIXED_SIZES and well_formed:
            payload = rng.randbytes(FIXED_SIZES[kind])
        else:
            payload = rng.randbytes(rng.choice([0, 1, 5, 9, rng.randrange(300)]))
        frames += frame(kind, flags, stream, payload)
    return frames[:rng.randrange(len(frames) + 1)] if rng.random() < 0.2 else frames


def test_random_frames_end_at_most_their_own_connection_and_log_no_unexpected_error(loop, caplog):
    """Seeded random frames on 400 connections, each written and then closed by the client: the server answers or
    ends each one, never fails in its own code (it would log an unexpected error), and serves a call afterwards."""
    _, address = loop.serve(METHODS)
    host, port = address.split(":")
    rng = random.Random(20)
    with caplog.at_level(logging.ERROR, logger="tandem.serve"):
        for _ in range(400):
            with socket.create_connection((host, int(port)), timeout=WAIT_S) as raw:
                raw.sendall(PREFACE + frame(SETTINGS, 0, 0, b"") + _random_frames(rng))
                raw.shutdown(socket.SHUT_WR)
                while raw.recv(65536):
                    pass
    assert [record.getMessage() for record in caplog.records] == []
    with channel(address) as chan:
        assert infer(chan)(service_pb2.ModelInferRequest(raw_input_contents=[b"ok"])).raw_output_contents == [b"ok"]


class Held:
    """A method whose calls wait for `release`; `entered` and `cancelled` tell the test where they are."""

    def __init__(self):
        self.entered = threading.Event()
        self.cancelled = threading.Event()
        self.release: asyncio.Event | None = None

    async def __call__(self, request, context):
        self.release = self.release or asyncio.Event()
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return service_pb2.ModelInferResponse(id=request.id)


def test_a_client_giving_up_cancels_its_call(loop):
    held = Held()
    _, address = loop.serve({INFER: (service_pb2.ModelInferRequest, held)})
    with channel(address) as chan:
        expired = refusal(lambda: infer(chan)(service_pb2.ModelInferRequest(), timeout=0.5))
        assert expired.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert held.cancelled.wait(WAIT_S), "the handler's task is cancelled by the client's RST_STREAM"


def test_a_graceful_close_finishes_the_calls_in_flight_and_takes_no_new_ones(loop):
    if loop.native:
        pytest.skip("behind the C front a server's close is the inference server's drain: test_grpc.py's drain test")
    held = Held()
    server, address = loop.serve({INFER: (service_pb2.ModelInferRequest, held)})
    with channel(address) as chan, ThreadPoolExecutor(1) as pool:
        running = pool.submit(infer(chan), service_pb2.ModelInferRequest(id="in flight"), timeout=WAIT_S)
        assert held.entered.wait(WAIT_S)
        closing = asyncio.run_coroutine_threadsafe(server.close(WAIT_S), loop.loop)
        wait_until(lambda: server.closing, what="the server closing")
        with channel(address, own_connection=True) as other:
            refused = refusal(lambda: infer(other)(service_pb2.ModelInferRequest(), timeout=WAIT_S))
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert not held.cancelled.is_set() and not closing.done()
        loop.loop.call_soon_threadsafe(held.release.set)
        assert running.result(WAIT_S).id == "in flight"
        closing.result(WAIT_S)


class Promised:
    """A method that returns a future (no task per call, as the inference RPC does): each call's future waits in
    `futures` for the test to settle it on the loop; id "refuse" fails at once with PERMISSION_DENIED, id "break"
    raises an unexpected error."""

    def __init__(self):
        self.futures: list[asyncio.Future] = []
        self.waiting = threading.Semaphore(0)

    def __call__(self, request, context) -> asyncio.Future:
        if request.id == "refuse":
            raise GrpcError(grpc.StatusCode.PERMISSION_DENIED, "not this one")
        if request.id == "break":
            raise RuntimeError("a defect in the handler")
        future = context.loop.create_future()
        self.futures.append(future)
        self.waiting.release()
        return future

    def next_call(self) -> asyncio.Future:
        assert self.waiting.acquire(timeout=WAIT_S), "no call reached the method"
        return self.futures[-1]


def test_a_method_returning_a_future_is_answered_refused_or_cancelled_by_it(loop, caplog):
    promised = Promised()
    _, address = loop.serve({INFER: (service_pb2.ModelInferRequest, promised)})
    with channel(address) as chan, ThreadPoolExecutor(2) as pool:
        answered = pool.submit(infer(chan), service_pb2.ModelInferRequest(id="kept"), timeout=WAIT_S)
        future = promised.next_call()
        loop.loop.call_soon_threadsafe(future.set_result, service_pb2.ModelInferResponse(id="kept"))
        assert answered.result(WAIT_S).id == "kept"

        failing = pool.submit(infer(chan), service_pb2.ModelInferRequest(id="fails later"), timeout=WAIT_S)
        future = promised.next_call()
        loop.loop.call_soon_threadsafe(future.set_exception, GrpcError(grpc.StatusCode.UNAVAILABLE, "gone"))
        with pytest.raises(grpc.RpcError) as failed:
            failing.result(WAIT_S)
        assert (failed.value.code(), failed.value.details()) == (grpc.StatusCode.UNAVAILABLE, "gone")

        refused = refusal(lambda: infer(chan)(service_pb2.ModelInferRequest(id="refuse"), timeout=WAIT_S))
        assert (refused.code(), refused.details()) == (grpc.StatusCode.PERMISSION_DENIED, "not this one")
        with caplog.at_level(logging.ERROR, logger="tandem"):
            broken = refusal(lambda: infer(chan)(service_pb2.ModelInferRequest(id="break"), timeout=WAIT_S))
        assert broken.code() == grpc.StatusCode.INTERNAL and "RuntimeError" in broken.details()
        assert "a defect in the handler" in caplog.text

        expired = refusal(lambda: infer(chan)(service_pb2.ModelInferRequest(id="given up"), timeout=0.5))
        assert expired.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        future = promised.next_call()
        wait_until(future.cancelled, what="the call's future cancelled by the client's RST_STREAM")

        again = pool.submit(infer(chan), service_pb2.ModelInferRequest(id="after"), timeout=WAIT_S)
        future = promised.next_call()
        loop.loop.call_soon_threadsafe(future.set_result, service_pb2.ModelInferResponse(id="after"))
        assert again.result(WAIT_S).id == "after"


class RecordingTransport(asyncio.Transport):
    """What a connection writes, write by write (a connection driven without a socket)."""

    def __init__(self):
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    def writelines(self, list_of_data) -> None:
        self.writes.append(b"".join(list_of_data))

    def is_closing(self) -> bool:
        return False


def test_the_answers_settled_in_one_turn_on_one_connection_go_out_in_one_write():
    """Four calls open on one connection, answered in one turn of the event loop: one write carries the four answers
    (one send, not four), each stream's frames whole and in order."""

    async def drive() -> list[bytes]:
        promised = Promised()
        connection = _Connection(GrpcServer({INFER: (service_pb2.ModelInferRequest, promised)}, LIMIT))
        transport = RecordingTransport()
        connection.connection_made(transport)
        request = service_pb2.ModelInferRequest().SerializeToString()
        headers = header_field(b":method", b"POST") + header_field(b":path", INFER.encode()) + \
            header_field(b"content-type", b"application/grpc")
        streams = [1, 3, 5, 7]
        connection.data_received(PREFACE + frame(SETTINGS, 0, 0, b"") + b"".join(
            frame(HEADERS, END_HEADERS, stream, headers) +
            frame(DATA, END_STREAM, stream, b"\0" + len(request).to_bytes(4, "big") + request) for stream in streams))
        await asyncio.sleep(0)  # what the connection owes for the client's SETTINGS goes out first
        transport.writes.clear()
        for number, future in enumerate(promised.futures):
            future.set_result(service_pb2.ModelInferResponse(id=str(number)))
        for _ in range(3):
            await asyncio.sleep(0)
        return transport.writes

    writes = asyncio.run(drive())
    assert len(writes) == 1, f"{len(writes)} writes"
    frames = _frames(writes[0])
    assert [(kind, stream) for kind, stream, _ in frames] == [
        (kind, stream) for stream in (1, 3, 5, 7) for kind in (HEADERS, DATA, HEADERS)]
    answers = [service_pb2.ModelInferResponse.FromString(payload[5:]).id for kind, _, payload in frames
               if kind == DATA]
    assert answers == ["0", "1", "2", "3"]
