"""The inference service's gRPC calls, one definition for both transports: a table of methods (path -> request type
and handler) served by grpcio's own server (`grpc.aio`) where the server listens on the gRPC port itself, and started
by `GrpcServer.start_call` for the calls the C front hands over (native.py's CallBridge) where the front owns the
port. HTTP/2, HPACK, flow control, the message size limits and the protocol's floods are grpc core's work (or
libnghttp2's behind the C front); what is ours here is only the service's calls and how their failures are answered.

grpc.aio's options come from the server's Limits (limits.py), never redefined here (`server_options`): the message
size both ways, calls at once per connection, the header list's size, the idle timeout (GOAWAY, then close), the time
a new connection has to send HTTP/2's preface and SETTINGS (the header timeout), the stream window (with no BDP
probing, so it stays as given), and the calls open at once in the process (`concurrent_calls`: one more is refused
RESOURCE_EXHAUSTED before its message is read). grpc core polices PINGs itself, with its defaults (PINGs more often
than it allows are strikes, answered with GOAWAY ENHANCE_YOUR_CALM; not in every run, see the issue's abuse
suite), and stops reading a client that leaves its acknowledgements unread. grpc.aio cannot change
a server's options once it runs: when the limits change (the model's full batch raises the message size once it
loads), `set_limits` starts a server with the new options on the same port (SO_REUSEPORT) and then closes the old one
gracefully (GOAWAY: its calls in flight finish, its clients reconnect to the new one).

A handler is a coroutine function, or a function returning an asyncio.Future of the answer (no task per call: the
inference RPC, whose answer is settled by a callback anyway); it raises GrpcError to fail its call.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from tandem.worker.serve.compression import DecompressError, decompress
from tandem.worker.serve.grpc_protocol import status_code
from tandem.worker.serve.limits import Limits

log = logging.getLogger("tandem.serve")


class GrpcError(Exception):
    """A call's failure, answered with `code` and `message` in its trailers."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# -- gRPC's messages, for the calls the C front hands over -----------------------------------------------------

_TIMEOUT = re.compile(r"(\d{1,8})([HMSmun])")
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def parse_timeout(value: str) -> float:
    """Seconds of a `grpc-timeout` header (up to 8 digits and a unit: H, M, S, m, u, n)."""
    match = _TIMEOUT.fullmatch(value)
    if match is None:
        raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, f"grpc-timeout {value!r} is not a timeout: give up to 8 "
                                                          "digits and a unit (H, M, S, m, u or n), as in 200m")
    return int(match.group(1)) * _TIMEOUT_UNITS[match.group(2)]


EXPIRED = "Deadline Exceeded"
"""The message of a call whose grpc-timeout is 0, as grpc core answers it on its own connections."""


def unary_message(body: bytes | bytearray, encoding: str | None, limit: int) -> bytes:
    """The one message of a unary call's body (gRPC's length-prefixed messages), decompressed when its flag says so
    (gzip or deflate, as `grpc-encoding` names it; at most `limit` bytes, before and after decompression)."""
    if len(body) < 5:
        raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, "the call holds no request message: a unary call sends one")
    compressed = body[0]
    if compressed > 1 or (compressed and encoding in (None, "identity")):
        raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request message's compressed flag is {compressed} with grpc-encoding {encoding}: a "
                        "compressed message (flag 1) needs grpc-encoding gzip or deflate")
    end = 5 + int.from_bytes(body[1:5], "big")
    if end - 5 > limit:
        raise GrpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"Received message larger than max ({end - 5} vs. {limit})")
    if len(body) < end:
        raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request message is cut short: {len(body) - 5} of the {end - 5} bytes its prefix gives")
    if len(body) > end:
        raise GrpcError(grpc.StatusCode.UNIMPLEMENTED,
                        "the call holds more than one request message: the service's methods are unary")
    if compressed:
        try:
            return decompress(bytes(body[5:]), encoding, limit, what="request message")
        except DecompressError as error:
            raise GrpcError(status_code(error.status), str(error)) from None
    return bytes(body[5:])


def as_grpc_error(error: BaseException) -> GrpcError:
    """What a call failing with `error` answers: a handler's own errors are GrpcErrors; anything else is a defect,
    logged and answered INTERNAL, never a crash."""
    if isinstance(error, GrpcError):
        return error
    log.error("unexpected error in a gRPC call", exc_info=error)
    return GrpcError(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}")


def server_options(limits: Limits) -> list[tuple[str, int]]:
    """grpc.aio's channel arguments for a server bounded by `limits`."""
    idle_ms = max(1, round(limits.idle_timeout_s * 1000))
    return [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", limits.max_message_bytes),
        ("grpc.max_concurrent_streams", limits.max_streams),
        ("grpc.max_metadata_size", limits.max_head_bytes),
        ("grpc.absolute_max_metadata_size", limits.max_head_bytes),
        ("grpc.max_connection_idle_ms", idle_ms),
        # grpc core has no body timeout: a call held open without finishing ends with its connection, which is
        # sent GOAWAY once it has lived an idle timeout and closed a body timeout later (its calls in flight
        # finish meanwhile; clients open a new connection for the next calls, as they do for any GOAWAY).
        ("grpc.max_connection_age_ms", idle_ms),
        ("grpc.max_connection_age_grace_ms", max(1, round(limits.body_timeout_s * 1000))),
        ("grpc.server_handshake_timeout_ms", max(1, round(limits.header_timeout_s * 1000))),
        ("grpc.http2.lookahead_bytes", limits.stream_window_bytes),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.so_reuseport", 1),
    ]


def concurrent_calls(limits: Limits) -> int:
    """Calls open at once in the process on grpc.aio's connections (grpc.aio refuses the next RESOURCE_EXHAUSTED,
    before reading its message): as many full messages as the process's buffer holds, and never fewer than one
    connection's streams."""
    return max(limits.max_streams, limits.process_buffer_bytes // limits.max_message_bytes)


# -- the server ---------------------------------------------------------------------------------------------

Handler = Callable[[Any, "CallContext"], Awaitable[Message]]
"""A coroutine function, or a function returning an asyncio.Future; either raises GrpcError to fail the call."""
Methods = dict[str, tuple[type[Message], Handler]]
"""The service's methods: path (/package.Service/Method) -> (request message type, handler)."""


class CallContext:
    """What a handler knows of its call beyond the request: its metadata (read-only: calls share it), its deadline,
    and the event loop it runs on. This one is a call's the C front handed over (its headers); AioContext adapts
    grpc.aio's."""

    __slots__ = ("headers", "deadline", "loop")

    def __init__(self, headers: dict[str, str], deadline: float | None, loop: asyncio.AbstractEventLoop):
        self.headers = headers
        self.deadline = deadline
        self.loop = loop

    def metadata(self, key: str) -> str | None:
        return self.headers.get(key)

    def time_remaining(self) -> float | None:
        """Seconds until the client's deadline; None without one."""
        return None if self.deadline is None else self.deadline - self.loop.time()


class AioContext(CallContext):
    """A call's context on grpc.aio's connections: its ServicerContext's metadata and deadline."""

    __slots__ = ("context",)

    def __init__(self, context: grpc.aio.ServicerContext, loop: asyncio.AbstractEventLoop):
        super().__init__({}, None, loop)
        self.context = context

    def metadata(self, key: str) -> str | None:
        for name, value in self.context.invocation_metadata() or ():
            if name == key:
                return value
        return None

    def time_remaining(self) -> float | None:
        return self.context.time_remaining()


class _Undecodable:
    """A request message that does not parse as its method's request type."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


class _Handlers(grpc.GenericRpcHandler):
    """The methods table as grpc.aio's handlers: each path's unary handler, with its request type's parser and the
    answer's serializer; a path not in the table answers UNIMPLEMENTED naming it."""

    def __init__(self, server: GrpcServer):
        self.server = server
        self.handlers = {path: grpc.unary_unary_rpc_method_handler(
            self._behaviour(handler), request_deserializer=self._parser(message_type),
            response_serializer=_serialize) for path, (message_type, handler) in server.methods.items()}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = self.handlers.get(details.method)
        if handler is None:
            return grpc.unary_unary_rpc_method_handler(self._unknown(details.method))
        return handler

    @staticmethod
    def _parser(message_type: type[Message]) -> Callable[[bytes], Any]:
        def parse(data: bytes) -> Any:
            try:
                return message_type.FromString(data)
            except DecodeError as error:
                return _Undecodable(f"the request is not a valid {message_type.DESCRIPTOR.full_name}: {error}")
        return parse

    def _behaviour(self, handler: Handler) -> Callable[..., Awaitable[Message]]:
        server = self.server

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Message:
            if request.__class__ is _Undecodable:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:  # grpc-timeout 0: grpc core may start the call regardless
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, EXPIRED)
            try:
                answer = handler(request, AioContext(context, asyncio.get_running_loop()))
                if not isinstance(answer, Message):
                    answer = await answer
                server.check_answer(answer)
            except Exception as error:  # noqa: BLE001 (every failure is the call's, answered)
                failure = as_grpc_error(error)
            else:
                return answer
            await context.abort(failure.code, failure.message)

        return call

    @staticmethod
    def _unknown(path: str) -> Callable[..., Awaitable[None]]:
        async def unknown(request: bytes, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"unknown method {path!r}")
        return unknown


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


class GrpcServer:
    """Serves `methods` on the running event loop: with grpc.aio on a port (`start`), and the calls the C front
    hands over (`start_call`, `outcome`), under `limits`."""

    def __init__(self, methods: Methods, limits: Limits):
        self.methods = methods
        self.limits = limits
        self._handlers = _Handlers(self)
        self._server: grpc.aio.Server | None = None
        self._address: str | None = None
        self._retiring: set[asyncio.Task] = set()  # servers closing after set_limits replaced them
        self.started = self.closing = False

    # -- grpc.aio on the port ---------------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> int:
        """Serve on host:port (0: any free port) with grpc.aio; the port. The port is bound with SO_REUSEPORT
        (grpc's default), which `set_limits` needs, and which lets the processes of a group each bind it
        (processes.py)."""
        self._server, port = await self._listen(f"{_host(host)}:{port}", self.limits)
        self._address = f"{_host(host)}:{port}"
        self.started = True
        return port

    async def _listen(self, address: str, limits: Limits) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(options=server_options(limits),
                                 maximum_concurrent_rpcs=concurrent_calls(limits))
        server.add_generic_rpc_handlers([self._handlers])
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as error:
            raise OSError(f"cannot listen for gRPC on {address}: {error}") from None
        await server.start()
        return server, port

    async def set_limits(self, limits: Limits) -> None:
        """Serve under `limits` from now on: the calls handed over at once; on grpc.aio's port, by a new server with
        their options, started beside the old one, which closes gracefully (see the module's docstring).

        With SO_REUSEPORT the kernel hashes each new connection to one of the port's listeners, and Linux resets the
        connections still queued on a listener when it closes (unless net.ipv4.tcp_migrate_req is 1, an unsafe
        sysctl on Kubernetes), so a client connecting in the instant the old one closes sees its connection reset
        and connects again (gRPC's clients do; a call without wait_for_ready fails UNAVAILABLE). The window is
        grpc core's time from the kernel's queueing a connection to its accepting it (a clean clone's test run
        under full load met it once). The limits change when the model loads, before the server is Ready, so no
        traffic a Service routes meets that change, and when a batching change moves the full batch's size (not
        when it keeps it: set_limits is then no swap). Connections already open are sent GOAWAY, not reset."""
        if server_options(limits) == server_options(self.limits) or self._server is None or self.closing:
            self.limits = limits
            return
        old = self._server
        self._server, _ = await self._listen(self._address, limits)
        self.limits = limits
        retiring = asyncio.get_running_loop().create_task(old.stop(limits.idle_timeout_s))
        self._retiring.add(retiring)
        retiring.add_done_callback(self._retiring.discard)

    # -- the calls the C front hands over ------------------------------------------------------------------------

    def start_call(self, headers: dict[str, str], body: bytes | bytearray,
                   loop: asyncio.AbstractEventLoop) -> asyncio.Future | Awaitable[Message] | None:
        """Start the call of a complete request (its headers and body): the handler's future or coroutine of the
        answer; None when the request is not gRPC's (its content-type: answered 415). Raises GrpcError where the
        request is refused before its handler runs (or the handler's own error)."""
        if not headers.get("content-type", "").startswith("application/grpc"):
            return None
        method = self.methods.get(headers.get(":path", ""))
        if method is None:
            raise GrpcError(grpc.StatusCode.UNIMPLEMENTED, f"unknown method {headers.get(':path')!r}")
        timeout = headers.get("grpc-timeout")
        deadline = None
        if timeout is not None:
            seconds = parse_timeout(timeout)
            if seconds <= 0:
                raise GrpcError(grpc.StatusCode.DEADLINE_EXCEEDED, EXPIRED)
            deadline = loop.time() + seconds
        message_type, handler = method
        body = unary_message(body, headers.get("grpc-encoding"), self.limits.max_message_bytes)
        try:
            request = message_type.FromString(body)
        except DecodeError as error:
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request is not a valid {message_type.DESCRIPTOR.full_name}: {error}") from None
        return handler(request, CallContext(headers, deadline, loop))

    def check_answer(self, message: Message) -> None:
        """GrpcError when `message` is larger than the server sends."""
        size = message.ByteSize()
        if size > self.limits.max_message_bytes:
            raise GrpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"Sent message larger than max ({size} vs. {self.limits.max_message_bytes})")

    def outcome(self, answer: Message | None, error: BaseException | None) -> tuple[int, str, bytes | None]:
        """A call's answer, or the error it failed with, for the C front to write: (its gRPC status code's number,
        its message as plain text, and for code 0 the answer's DATA: the message, length-prefixed; None
        otherwise)."""
        if error is None:
            try:
                self.check_answer(answer)
                data = answer.SerializeToString()
                return 0, "", b"\0" + len(data).to_bytes(4, "big") + data
            except Exception as failure:  # noqa: BLE001 (a defect in the answer: answered INTERNAL)
                error = failure
        error = as_grpc_error(error)
        return error.code.value[0], error.message, None

    async def close(self, grace_seconds: float = 1.0) -> None:
        """Stop listening and taking calls; calls still running get `grace_seconds` to write their answers, then are
        cancelled."""
        if not self.started or self.closing:
            return
        self.closing = True
        servers = [] if self._server is None else [self._server.stop(grace_seconds)]
        self._server = None
        await asyncio.gather(*servers, *self._retiring)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host

