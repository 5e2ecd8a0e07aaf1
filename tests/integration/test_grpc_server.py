"""The gRPC server (worker/serve/grpc_server.py) on grpcio's own server (grpc.aio) on a real socket on 127.0.0.1, with
small methods of its own and grpcio's client: large messages both ways, the message size limit (and its raise once a
model loads), refusals, metadata and deadlines, cancellation, a client that does not speak HTTP/2, an idle
connection, and a graceful close. Calls are held at a known point with events, never with sleeps;
outcomes are asserted, not timings. The calls the C front hands to the same GrpcServer are tested with the front
(test_native_grpc.py); start_call's and outcome's refusals without a socket in tests/unit/test_grpc_wire.py."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from h2_frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PREFACE,
    answer_headers,
    frame,
    goaway_code,
    grpc_headers,
    grpc_message,
    header_block,
    hello,
    read_until_closed,
)
from serving import wait_until
from tritonclient.grpc import service_pb2

from tandem.worker.serve.background import new_event_loop
from tandem.worker.serve.grpc_server import CallContext, GrpcError, GrpcServer
from tandem.worker.serve.limits import Limits

WAIT_S = 30
LIMITS = Limits(max_message_bytes=8 << 20)
INFER = "/inference.GRPCInferenceService/ModelInfer"
LIVE = "/inference.GRPCInferenceService/ServerLive"


class Loop:
    """An event loop (uvloop, as `tandem serve` runs) on a thread of its own, and the servers started on it."""

    def __init__(self):
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[GrpcServer] = []

    def run(self, coroutine, timeout: float = WAIT_S):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def serve(self, methods, limits: Limits = LIMITS) -> tuple[GrpcServer, str]:
        server = GrpcServer(methods, limits)
        port = self.run(server.start("127.0.0.1", 0))
        self.servers.append(server)
        return server, f"127.0.0.1:{port}"

    def close(self) -> None:
        for server in self.servers:
            self.run(server.close(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)
        self.loop.close()


@pytest.fixture
def loop() -> Iterator[Loop]:
    running = Loop()
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


def infer(chan: grpc.Channel, path: str = INFER) -> grpc.UnaryUnaryMultiCallable:
    return chan.unary_unary(path, request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                            response_deserializer=service_pb2.ModelInferResponse.FromString)


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def served(address: str, reconnecting: bool = False) -> bool:
    """A call on a connection of its own is answered; `reconnecting`: the client waits for its channel to be ready
    (gRPC's wait_for_ready), connecting again if its first connection is reset."""
    with channel(address, own_connection=True) as chan:
        ok = service_pb2.ModelInferRequest(raw_input_contents=[b"ok"])
        return infer(chan)(ok, timeout=WAIT_S, wait_for_ready=reconnecting).raw_output_contents == [b"ok"]


def raw_connection(address: str) -> socket.socket:
    host, port = address.split(":")
    return socket.create_connection((host, int(port)), timeout=WAIT_S)


def test_large_messages_both_ways_on_concurrent_calls(loop):
    """3 MiB requests and 6 MiB answers, eight at once on one connection."""
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


def test_a_message_over_the_limit_is_resource_exhausted_and_the_server_serves_on(loop):
    _, address = loop.serve(METHODS, Limits(max_message_bytes=1 << 20))
    with channel(address) as chan:
        too_big = service_pb2.ModelInferRequest(raw_input_contents=[b"x" * (2 << 20)])
        refused = refusal(lambda: infer(chan)(too_big, timeout=WAIT_S))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in refused.details() and "1048576" in refused.details()
        answer_too_big = service_pb2.ModelInferRequest(id="3", raw_input_contents=[b"x" * (512 << 10)])
        refused = refusal(lambda: infer(chan)(answer_too_big, timeout=WAIT_S))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Sent message larger" in refused.details()
        fits = service_pb2.ModelInferRequest(raw_input_contents=[b"y" * (512 << 10)])
        assert infer(chan)(fits, timeout=WAIT_S).raw_output_contents == [b"y" * (512 << 10)]


def test_raised_limits_take_a_message_refused_before_and_the_old_connections_move_over(loop):
    """grpc.aio fixes its options when it starts: set_limits starts a server with the new ones on the same port and
    closes the old one gracefully. A message refused under the old limit is served under the new one, by a client
    whose channel was connected to the old server, and a call in flight across the change is answered. A client
    connecting at the change may have its connection reset (see set_limits), so the new connection's client
    reconnects: a clean clone's run caught that reset once under load."""
    held = Held()
    server, address = loop.serve({**METHODS, LIVE: (service_pb2.ModelInferRequest, held)},
                                 Limits(max_message_bytes=1 << 20))
    big = service_pb2.ModelInferRequest(raw_input_contents=[b"z" * (2 << 20)])
    with channel(address) as chan, ThreadPoolExecutor(1) as pool:
        assert refusal(lambda: infer(chan)(big, timeout=WAIT_S)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        in_flight = pool.submit(infer(chan, LIVE), service_pb2.ModelInferRequest(id="across"), timeout=WAIT_S)
        assert held.entered.wait(WAIT_S)
        raised = Limits(max_message_bytes=4 << 20)
        loop.run(server.set_limits(raised))  # returns once the new server serves, the old one closing
        assert served(address, reconnecting=True)
        loop.loop.call_soon_threadsafe(held.release.set)
        assert in_flight.result(WAIT_S).id == "across"
        wait_until(lambda: not server._retiring, what="the old server closed")
        assert infer(chan)(big, timeout=WAIT_S, wait_for_ready=True).raw_output_contents == [b"z" * (2 << 20)]


async def fail(request, context):
    if request.id == "grpc":
        raise GrpcError(grpc.StatusCode.FAILED_PRECONDITION, "na\u00efve: 100% refused\non two lines")
    raise KeyError("a defect")


def test_refusals_have_their_codes_and_messages_and_the_server_lives_on(loop, caplog):
    _, address = loop.serve({**METHODS, "/t/Fail": (service_pb2.ModelInferRequest, fail)})
    with channel(address) as chan:
        unknown = refusal(lambda: infer(chan, "/inference.GRPCInferenceService/ModelStreamInfer")(
            service_pb2.ModelInferRequest(), timeout=WAIT_S))
        assert unknown.code() == grpc.StatusCode.UNIMPLEMENTED and "ModelStreamInfer" in unknown.details()
        failed = refusal(lambda: infer(chan, "/t/Fail")(service_pb2.ModelInferRequest(id="grpc"), timeout=WAIT_S))
        assert (failed.code(), failed.details()) == (grpc.StatusCode.FAILED_PRECONDITION,
                                                     "na\u00efve: 100% refused\non two lines")
        with caplog.at_level(logging.ERROR, logger="tandem.serve"):
            defect = refusal(lambda: infer(chan, "/t/Fail")(service_pb2.ModelInferRequest(), timeout=WAIT_S))
        assert defect.code() == grpc.StatusCode.INTERNAL and "KeyError" in defect.details()
        assert "unexpected error in a gRPC call" in caplog.text
        for compression in (grpc.Compression.Gzip, grpc.Compression.Deflate):
            compressed = infer(chan)(service_pb2.ModelInferRequest(raw_input_contents=[b"a" * 10_000]),
                                     timeout=WAIT_S, compression=compression)
            assert compressed.raw_output_contents == [b"a" * 10_000]
        not_protobuf = chan.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        garbage = refusal(lambda: not_protobuf(b"\xff\xff\xff", timeout=WAIT_S))
        assert garbage.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid inference.ModelInferRequest" in garbage.details()
    assert served(address)


def test_a_client_that_does_not_speak_http2_is_closed_and_others_are_served(loop):
    _, address = loop.serve(METHODS)
    with raw_connection(address) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        received = read_until_closed(raw)
    assert b"HTTP/1.1 200" not in received
    assert served(address)


@pytest.mark.parametrize("timeout", ["0n", "0S", "0H"])
def test_a_grpc_timeout_of_zero_is_deadline_exceeded_before_the_handler(loop, timeout):
    called = threading.Event()

    async def handler(request, context):
        called.set()
        return service_pb2.ModelInferResponse()

    _, address = loop.serve({INFER: (service_pb2.ModelInferRequest, handler)})
    with raw_connection(address) as raw:
        raw.sendall(hello() + frame(HEADERS, END_HEADERS, 1, header_block(grpc_headers(INFER, **{
            "grpc-timeout": timeout}))) + frame(DATA, END_STREAM, 1, grpc_message(b"")))
        headers = answer_headers(raw, 1)
    assert headers["grpc-status"] == "4", headers
    assert not called.is_set()


def test_an_idle_connection_is_closed_with_goaway_and_others_are_served(loop):
    """A connection that sent its preface and nothing since, one that sent half a preface, and one that served a
    call and then idled: all closed once the (short) idle or header timeout passes; new ones are served."""
    _, address = loop.serve(METHODS, Limits(idle_timeout_s=0.3, header_timeout_s=0.3))
    with raw_connection(address) as idle, raw_connection(address) as half:
        idle.sendall(hello())
        half.sendall(PREFACE[:7])
        assert goaway_code(read_until_closed(idle)) is not None
        read_until_closed(half)  # returns: closed
    with channel(address, own_connection=True) as chan:
        ok = service_pb2.ModelInferRequest(raw_input_contents=[b"ok"])
        states: list[grpc.ChannelConnectivity] = []
        chan.subscribe(states.append)
        assert infer(chan)(ok, timeout=WAIT_S).raw_output_contents == [b"ok"]
        wait_until(lambda: grpc.ChannelConnectivity.READY in states and states[-1] == grpc.ChannelConnectivity.IDLE,
                   what="the client's connection closed by the server once idle")
    assert served(address)


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
        assert held.cancelled.wait(WAIT_S), "the handler's task is cancelled when the client gives up"


def test_a_graceful_close_finishes_the_calls_in_flight_and_takes_no_new_ones(loop):
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
        wait_until(future.cancelled, what="the call's future cancelled when its client gave up")

        again = pool.submit(infer(chan), service_pb2.ModelInferRequest(id="after"), timeout=WAIT_S)
        future = promised.next_call()
        loop.loop.call_soon_threadsafe(future.set_result, service_pb2.ModelInferResponse(id="after"))
        assert again.result(WAIT_S).id == "after"
