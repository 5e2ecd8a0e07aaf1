"""A small gRPC server for the inference service: unary calls over HTTP/2 framed by hand on an asyncio Protocol, with
hpack's decoder for request headers.

Why not grpc.aio: per call of a tiny handler, grpc.aio's machinery (its completion queue, poller thread and the
hand-offs between them) cost 4-12 times the CPU of this protocol on the same event loop, and h2 or grpclib (h2's
state machine and events in pure Python) 0.6-1.7 times grpc.aio's; on a CPU-bound inference server that CPU comes
straight out of the model's forward passes (bench/bench_grpc_stack.py, measured in bench/RESULTS.md). What it
does, and all it does:

- HTTP/2 over cleartext with prior knowledge (what a gRPC client speaks on an insecure channel): SETTINGS, PING,
  flow control both ways (a stream's window is large enough for its one message; the connection's is topped up as
  data arrives; answers wait for the client's window), padded frames, header blocks continued over CONTINUATION
  frames (a header block up to 64 KiB), RST_STREAM, at most MAX_STREAMS calls at once per connection (further streams
  are refused, as the server's SETTINGS announce). A breach of the protocol closes the connection with a GOAWAY
  naming it.
- unary RPCs: the path names the method; the request's one message, up to `max_message` bytes (RESOURCE_EXHAUSTED
  beyond, at once), uncompressed or compressed with gzip or deflate (`grpc-encoding`; answers go uncompressed); the
  call's deadline from `grpc-timeout`; the request's headers as its metadata; the answer, or a status code and its
  message (percent-encoded) in the trailers.
- back-pressure: while the client reads slower than the server writes, its frames are not read;
- a client's RST_STREAM cancels its call; `close` sends GOAWAY, lets the calls in flight finish within a grace
  period, then cancels the rest.

A handler is a coroutine function, or a function returning an asyncio.Future of the answer (no task per call: the
inference RPC, whose answer is settled by a callback anyway).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import hpack
from google.protobuf.message import DecodeError, Message

from tandem.worker.serve.grpc_protocol import status_code
from tandem.worker.serve.http import Adoptions, DecompressError, Listen, decompress, listen, port_of

log = logging.getLogger("tandem.serve")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x6, 0x7, 0x9, 0xB
SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x3, 0x4, 0x5

MAX_FRAME = 16384  # the largest frame taken and the largest sent until the client allows more: HTTP/2's default
MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65535
STREAM_WINDOW = 1 << 30  # each stream's receive window: its one message never waits for a WINDOW_UPDATE
CONNECTION_WINDOW = 1 << 30  # the connection's, topped up once half of it is used
MAX_STREAMS = 256  # calls open at once on one connection; a client's further streams are refused (it retries them)
FLUSH_BYTES = 64 << 10  # frames held for one write per turn of the event loop, at most (_Connection._write)
MAX_HEADER_BLOCK = 64 << 10  # a header block's bytes, CONTINUATION frames included (hpack's own limit once decoded)


class GrpcError(Exception):
    """A call's failure, answered with `code` and `message` in its trailers."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class ConnectionFailure(Exception):
    """A breach of HTTP/2 by the client: the connection ends with GOAWAY and `code`."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


# -- the wire's pure parts -------------------------------------------------------------------------------------

def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def _hpack_integer(value: int, prefix_bits: int, high_bits: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((high_bits | value,))
    out = [high_bits | limit]
    value -= limit
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def header_field(name: bytes, value: bytes) -> bytes:
    """One header as HPACK's literal without indexing, new name, no Huffman coding: it touches neither side's dynamic
    table, so a block of them means the same on every connection."""
    return b"\0" + _hpack_integer(len(name), 7) + name + _hpack_integer(len(value), 7) + value


def percent_encode(message: str) -> bytes:
    """grpc-message's encoding: UTF-8, with '%' and bytes outside printable ASCII as %XX."""
    data = message.encode("utf-8")
    return b"".join(bytes((byte,)) if 0x20 <= byte <= 0x7E and byte != 0x25 else b"%%%02X" % byte for byte in data)


_TIMEOUT = re.compile(r"(\d{1,8})([HMSmun])")
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def parse_timeout(value: str) -> float:
    """Seconds of a `grpc-timeout` header (up to 8 digits and a unit: H, M, S, m, u, n)."""
    match = _TIMEOUT.fullmatch(value)
    if match is None:
        raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, f"grpc-timeout {value!r} is not a timeout: give up to 8 "
                                                          "digits and a unit (H, M, S, m, u or n), as in 200m")
    return int(match.group(1)) * _TIMEOUT_UNITS[match.group(2)]


def unary_message(body: bytes | bytearray, encoding: str | None, limit: int) -> bytes:
    """The one message of a unary call's body (gRPC's length-prefixed messages), decompressed when its flag says so
    (gzip or deflate, as `grpc-encoding` names it; at most `limit` bytes once decompressed)."""
    if len(body) < 5:
        raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, "the call holds no request message: a unary call sends one")
    compressed = body[0]
    if compressed > 1 or (compressed and encoding in (None, "identity")):
        raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request message's compressed flag is {compressed} with grpc-encoding {encoding}: a "
                        "compressed message (flag 1) needs grpc-encoding gzip or deflate")
    end = 5 + int.from_bytes(body[1:5], "big")
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


def parse_settings(payload: bytes) -> dict[int, int]:
    """A SETTINGS frame's values by identifier, checked where they bear on this server."""
    if len(payload) % 6:
        raise ConnectionFailure(FRAME_SIZE_ERROR, f"a SETTINGS frame of {len(payload)} bytes (a multiple of 6)")
    settings = {int.from_bytes(payload[i:i + 2], "big"): int.from_bytes(payload[i + 2:i + 6], "big")
                for i in range(0, len(payload), 6)}
    if settings.get(SETTINGS_INITIAL_WINDOW_SIZE, 0) > MAX_WINDOW:
        raise ConnectionFailure(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1")
    if not MAX_FRAME <= settings.get(SETTINGS_MAX_FRAME_SIZE, MAX_FRAME) < 1 << 24:
        raise ConnectionFailure(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE outside 2^14..2^24-1")
    return settings


def unpad(payload: bytes, flags: int) -> bytes:
    """A DATA or HEADERS frame's payload without its padding."""
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ConnectionFailure(PROTOCOL_ERROR, "padding as long as the frame")
    return payload[1:len(payload) - payload[0]]


class HeaderDecoder:
    """HPACK's decoder for one connection's request headers, which remembers the blocks that leave its dynamic table as
    they found it: a client sends the same block call after call (indexed headers, or h2load's literals), and hpack
    decodes in pure Python (40% of the event loop's time per call without this). A block's headers depend only on the
    block and the table's contents, so what is remembered holds until the table changes."""

    def __init__(self, remember: int = 64):
        self.decoder = hpack.Decoder()
        self.known: dict[bytes, dict[str, str]] = {}
        self.remember = remember

    def decode(self, block: bytes) -> dict[str, str]:
        headers = self.known.get(block)
        if headers is not None:
            return headers
        table = self.decoder.header_table
        before = (table.maxsize, tuple(table.dynamic_entries))
        try:
            fields = self.decoder.decode(block, raw=True)
        except hpack.HPACKError as error:
            raise ConnectionFailure(COMPRESSION_ERROR, f"a header block HPACK cannot decode: {error}") from None
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in fields}
        if (table.maxsize, tuple(table.dynamic_entries)) != before:
            self.known.clear()
        elif len(self.known) < self.remember:
            self.known[block] = headers
        return headers


RESPONSE_HEADERS = header_field(b":status", b"200") + header_field(b"content-type", b"application/grpc") + \
    header_field(b"grpc-accept-encoding", b"identity,deflate,gzip")
OK_TRAILERS = header_field(b"grpc-status", b"0")


UNSUPPORTED_MEDIA = header_field(b":status", b"415")
"""The answer to a request whose content-type is not gRPC's (a trailers-only HTTP answer)."""


def status_block(code: grpc.StatusCode, message: str) -> bytes:
    return header_field(b"grpc-status", str(code.value[0]).encode()) + \
        header_field(b"grpc-message", percent_encode(message))


def as_grpc_error(error: BaseException) -> GrpcError:
    """What a call failing with `error` answers: a handler's own errors are GrpcErrors; anything else is a defect,
    logged and answered INTERNAL, never a crash."""
    if isinstance(error, GrpcError):
        return error
    log.error("unexpected error in a gRPC call", exc_info=error)
    return GrpcError(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}")


# -- the server ---------------------------------------------------------------------------------------------

Handler = Callable[[Any, "CallContext"], Awaitable[Message]]
"""A coroutine function, or a function returning an asyncio.Future; either raises GrpcError to fail the call."""
Methods = dict[str, tuple[type[Message], Handler]]
"""The service's methods: path (/package.Service/Method) -> (request message type, handler)."""


class CallContext:
    """What a handler knows of its call beyond the request: its metadata (read-only: calls share it) and its
    deadline."""

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


class GrpcServer:
    """Serves `methods` on the running event loop."""

    def __init__(self, methods: Methods, max_message: int):
        self.methods = methods
        self.max_message = max_message
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self.started = self.closing = False
        self.adopt = Adoptions(lambda received: _Connection(self), lambda: self.closing).adopt

    async def start(self, host: str, port: Listen) -> int:
        """Listen on host:port (0: any free port), or nowhere (HandedOver: see `adopt`); the port."""
        try:
            self._server = await listen(lambda: _Connection(self), host, port)
        except OSError as error:
            raise OSError(f"cannot listen for gRPC on {host}:{port}: {error}") from error
        self.started = True
        return port_of(self._server, port)

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
        message_type, handler = method
        body = unary_message(body, headers.get("grpc-encoding"), self.max_message)
        try:
            request = message_type.FromString(body)
        except DecodeError as error:
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request is not a valid {message_type.DESCRIPTOR.full_name}: {error}") from None
        timeout = headers.get("grpc-timeout")
        deadline = None if timeout is None else loop.time() + parse_timeout(timeout)
        return handler(request, CallContext(headers, deadline, loop))

    def encode(self, message: Message) -> bytes:
        """An answer's DATA: the message, length-prefixed; GrpcError when it is larger than the server's limit."""
        answer = message.SerializeToString()
        if len(answer) > self.max_message:
            raise GrpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the answer of {len(answer)} bytes is larger "
                            f"than the server's limit of {self.max_message} bytes")
        return b"\0" + len(answer).to_bytes(4, "big") + answer

    def outcome(self, answer: Message | None, error: BaseException | None) -> tuple[bytes | None, bytes | None, bytes]:
        """A call's answer, or the error it failed with, as HTTP/2 sends it: (headers, DATA, trailers), the header
        blocks in HPACK (headers None: a trailers-only answer); for the C front, which owns the connection
        (native.py)."""
        if error is None:
            try:
                return RESPONSE_HEADERS, self.encode(answer), OK_TRAILERS
            except Exception as failure:
                error = failure
        error = as_grpc_error(error)
        return None, None, RESPONSE_HEADERS + status_block(error.code, error.message)

    async def close(self, grace_seconds: float = 1.0) -> None:
        """Stop listening and taking calls; calls still running get `grace_seconds` to write their answers."""
        if not self.started or self.closing:
            return
        self.closing = True
        if self._server is not None:
            self._server.close()
            self._server = None
        for connection in list(self._connections):
            connection.go_away()
        running = [call for connection in self._connections for call in connection.calls()]
        if running:
            await asyncio.wait(running, timeout=grace_seconds)
        for connection in list(self._connections):
            connection.abort()


class _Stream:
    __slots__ = ("id", "headers", "block", "body", "call", "send_window", "outgoing")

    def __init__(self, stream_id: int, send_window: int):
        self.id = stream_id
        self.headers: dict[str, str] | None = None
        self.block = b""  # a header block while its CONTINUATION frames arrive
        self.body = bytearray()
        self.call: asyncio.Future | None = None  # the handler's task or future, once the request is complete
        self.send_window = send_window
        self.outgoing: memoryview | None = None  # the answer's DATA waiting for the client's window


class _Connection(asyncio.Protocol):
    def __init__(self, server: GrpcServer):
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.started = False
        self.decoder = HeaderDecoder()
        self.streams: dict[int, _Stream] = {}
        self.blocked: dict[int, _Stream] = {}  # streams whose answer waits for a window
        self.last_stream = 0
        self.continuing: tuple[_Stream, int] | None = None  # a header block in progress: its stream and flags
        self.going_away = False
        self.send_window = DEFAULT_WINDOW
        self.initial_send_window = DEFAULT_WINDOW
        self.max_send_frame = MAX_FRAME
        self.unacknowledged = 0  # DATA bytes taken since the connection's window was last topped up
        self.unsent: list[bytes] = []  # frames written in this turn of the event loop (_write)
        self.unsent_bytes = 0

    def calls(self) -> list[asyncio.Future]:
        return [stream.call for stream in self.streams.values() if stream.call is not None and not stream.call.done()]

    # -- connection life ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.server._connections.add(self)
        settings = SETTINGS_INITIAL_WINDOW_SIZE.to_bytes(2, "big") + STREAM_WINDOW.to_bytes(4, "big") + \
            SETTINGS_MAX_CONCURRENT_STREAMS.to_bytes(2, "big") + MAX_STREAMS.to_bytes(4, "big")
        transport.write(frame(SETTINGS, 0, 0, settings) +
                        frame(WINDOW_UPDATE, 0, 0, (CONNECTION_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")))
        if self.server.closing:  # accepted as the server stopped listening
            self.go_away()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server._connections.discard(self)
        for stream in self.streams.values():
            if stream.call is not None:
                stream.call.cancel()
        self.streams.clear()
        self.blocked.clear()

    def pause_writing(self) -> None:
        """The client reads slower than the server writes (answers piling up, or a flood of PINGs or SETTINGS each
        owed an acknowledgement): read none of its frames until it catches up, so what waits to be written stays
        bounded."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def go_away(self) -> None:
        """Take no new calls (GOAWAY naming the last one taken); close at once when none is running."""
        self.going_away = True
        self._write(frame(GOAWAY, 0, 0, self.last_stream.to_bytes(4, "big") + NO_ERROR.to_bytes(4, "big")))
        if not self.streams:
            self._close()

    def abort(self) -> None:
        self._close()
        self.connection_lost(None)

    def _close(self) -> None:
        """Close the connection once what was written is sent."""
        if self.transport is not None:
            self._flush()
            self.transport.close()

    def _fail(self, code: int, message: str) -> None:
        log.info("gRPC connection closed: %s", message)
        self._write(frame(GOAWAY, 0, 0, self.last_stream.to_bytes(4, "big") + code.to_bytes(4, "big") +
                          message.encode()))
        self.abort()

    def _write(self, data: bytes) -> None:
        """Send `data` at the end of this turn of the event loop, together with what else the connection sends in it:
        the answers a batch completes on one connection go out in one write, not a write each (measured in
        bench/RESULTS.md). Sooner when the last open call is answered (_forget), and past FLUSH_BYTES, so that a
        client reading slower than the server writes pauses the reading (pause_writing) as soon as the transport's
        buffer fills, within one turn."""
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if not self.unsent:
                self.loop.call_soon(self._flush)
            self.unsent.append(data)
            self.unsent_bytes += len(data)
            if self.unsent_bytes > FLUSH_BYTES:
                self._flush()

    def _flush(self) -> None:
        unsent, self.unsent, self.unsent_bytes = self.unsent, [], 0
        transport = self.transport
        if unsent and transport is not None and not transport.is_closing():
            transport.writelines(unsent)

    # -- reading ------------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        try:
            self._read(data)
        except ConnectionFailure as failure:
            self._fail(failure.code, str(failure))
        except Exception as error:
            log.error("unexpected error reading a gRPC connection", exc_info=error)
            self._fail(INTERNAL_ERROR, f"internal error: {type(error).__name__}")

    def _read(self, data: bytes) -> None:
        buffer = self.buffer + data if self.buffer else data
        if not self.started:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(buffer):
                    raise ConnectionFailure(PROTOCOL_ERROR, "not HTTP/2's client preface: a gRPC server speaks "
                                                            "HTTP/2 (h2c, prior knowledge)")
                self.buffer = buffer
                return
            if not buffer.startswith(PREFACE):
                raise ConnectionFailure(PROTOCOL_ERROR, "not HTTP/2's client preface: a gRPC server speaks HTTP/2 "
                                                        "(h2c, prior knowledge)")
            buffer, self.started = buffer[len(PREFACE):], True
        offset, size = 0, len(buffer)
        while size - offset >= 9 and self.transport is not None:
            length = int.from_bytes(buffer[offset:offset + 3], "big")
            if length > MAX_FRAME:
                raise ConnectionFailure(FRAME_SIZE_ERROR, f"a frame of {length} bytes, above {MAX_FRAME}")
            end = offset + 9 + length
            if end > size:
                break
            kind, flags = buffer[offset + 3], buffer[offset + 4]
            stream_id = int.from_bytes(buffer[offset + 5:offset + 9], "big") & 0x7FFFFFFF
            payload = buffer[offset + 9:end]
            offset = end
            if self.continuing is not None and kind != CONTINUATION:
                raise ConnectionFailure(PROTOCOL_ERROR, "a header block interrupted before END_HEADERS")
            if kind == DATA:
                self._on_data(stream_id, flags, payload)
            elif kind == HEADERS:
                self._on_headers(stream_id, flags, payload)
            elif kind == CONTINUATION:
                self._on_continuation(stream_id, flags, payload)
            elif kind == SETTINGS:
                if not flags & ACK:
                    self._on_settings(parse_settings(payload))
            elif kind == WINDOW_UPDATE:
                self._on_window_update(stream_id, payload)
            elif kind == RST_STREAM:
                self._on_reset(stream_id)
            elif kind == PING:
                if len(payload) != 8:
                    raise ConnectionFailure(FRAME_SIZE_ERROR, f"a PING frame of {len(payload)} bytes (8)")
                if not flags & ACK:
                    self._write(frame(PING, ACK, 0, payload))
            elif kind == PUSH_PROMISE:
                raise ConnectionFailure(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
            # PRIORITY, GOAWAY (the client closes its side itself) and unknown kinds: nothing to do
        self.buffer = buffer[offset:]
        if self.unacknowledged > CONNECTION_WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, 0, self.unacknowledged.to_bytes(4, "big")))
            self.unacknowledged = 0

    def _on_data(self, stream_id: int, flags: int, payload: bytes) -> None:
        self.unacknowledged += len(payload)
        stream = self.streams.get(stream_id)
        if stream is None or stream.call is not None or stream.headers is None:
            return  # a stream refused or reset already, or answered: its data is dropped
        stream.body += unpad(payload, flags)
        if len(stream.body) > self.server.max_message + 5:
            self._refuse(stream, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"the request message is larger than the server's limit of {self.server.max_message} bytes")
        elif flags & END_STREAM:
            self._dispatch(stream)

    def _on_headers(self, stream_id: int, flags: int, payload: bytes) -> None:
        payload = unpad(payload, flags)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id % 2 == 0:
                raise ConnectionFailure(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}, not a client's stream")
            if stream_id <= self.last_stream:  # trailers of a stream refused or reset already: read, then dropped
                stream = _Stream(stream_id, 0)
            elif len(self.streams) >= MAX_STREAMS:  # past the limit the settings gave: refused, its headers still read
                self.last_stream = stream_id
                stream = _Stream(stream_id, 0)
                self._write(frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
            else:
                self.last_stream = stream_id
                stream = self.streams[stream_id] = _Stream(stream_id, self.initial_send_window)
        if len(payload) > MAX_HEADER_BLOCK:
            raise ConnectionFailure(ENHANCE_YOUR_CALM, f"a header block of over {MAX_HEADER_BLOCK} bytes")
        if flags & END_HEADERS:
            self._on_header_block(stream, flags, payload)
        else:
            stream.block = payload
            self.continuing = (stream, flags)

    def _on_continuation(self, stream_id: int, flags: int, payload: bytes) -> None:
        if self.continuing is None or self.continuing[0].id != stream_id:
            raise ConnectionFailure(PROTOCOL_ERROR, f"CONTINUATION on stream {stream_id} with no header block open")
        stream, first_flags = self.continuing
        stream.block += payload
        if len(stream.block) > MAX_HEADER_BLOCK:
            raise ConnectionFailure(ENHANCE_YOUR_CALM, f"a header block of over {MAX_HEADER_BLOCK} bytes")
        if flags & END_HEADERS:
            self.continuing = None
            block, stream.block = stream.block, b""
            self._on_header_block(stream, first_flags, block)

    def _on_header_block(self, stream: _Stream, flags: int, block: bytes) -> None:
        headers = self.decoder.decode(block)
        if self.streams.get(stream.id) is not stream:
            return  # a stream gone already: its block was decoded only to keep HPACK's table in step
        if stream.headers is not None:  # the client's trailers
            if flags & END_STREAM and stream.call is None:
                self._dispatch(stream)
            return
        stream.headers = headers
        if self.going_away:
            self._write(frame(RST_STREAM, 0, stream.id, REFUSED_STREAM.to_bytes(4, "big")))
            self._forget(stream)
        elif flags & END_STREAM:
            self._dispatch(stream)

    def _on_settings(self, settings: dict[int, int]) -> None:
        self._write(frame(SETTINGS, ACK, 0, b""))
        self.max_send_frame = settings.get(SETTINGS_MAX_FRAME_SIZE, self.max_send_frame)
        window = settings.get(SETTINGS_INITIAL_WINDOW_SIZE)
        if window is not None:
            change, self.initial_send_window = window - self.initial_send_window, window
            for stream in self.streams.values():
                stream.send_window += change
            if change > 0:
                self._flush_blocked()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionFailure(FRAME_SIZE_ERROR, f"a WINDOW_UPDATE frame of {len(payload)} bytes (4)")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionFailure(FLOW_CONTROL_ERROR, "the connection's window grown above 2^31-1")
            self._flush_blocked()
            return
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.send_window += increment
            if stream_id in self.blocked:
                del self.blocked[stream_id]
                self._send_data(stream)

    def _on_reset(self, stream_id: int) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._forget(stream)
            if stream.call is not None:
                stream.call.cancel()

    # -- calls ------------------------------------------------------------------------------------------

    def _dispatch(self, stream: _Stream) -> None:
        """The request is complete: start its call (or answer its failure)."""
        try:
            call = self.server.start_call(stream.headers, stream.body, self.loop)
        except Exception as error:
            self._failed(stream, error)
            return
        stream.body = bytearray()
        if call is None:
            self._write(frame(HEADERS, END_HEADERS | END_STREAM, stream.id, UNSUPPORTED_MEDIA))
            self._forget(stream)
        elif isinstance(call, asyncio.Future):
            stream.call = call
            call.add_done_callback(lambda done: self._settled(stream, done))
        else:
            stream.call = self.loop.create_task(self._call(stream, call))

    async def _call(self, stream: _Stream, call: Awaitable[Message]) -> None:
        try:
            answer = await call
        except Exception as error:
            self._failed(stream, error)
            return
        self._answer(stream, answer)

    def _settled(self, stream: _Stream, call: asyncio.Future) -> None:
        if call.cancelled():
            return
        error = call.exception()
        if error is None:
            self._answer(stream, call.result())
        else:
            self._failed(stream, error)

    def _failed(self, stream: _Stream, error: BaseException) -> None:
        error = as_grpc_error(error)
        self._answer_status(stream, error.code, error.message)

    def _answer(self, stream: _Stream, message: Message) -> None:
        try:
            data = self.server.encode(message)
        except Exception as error:
            self._failed(stream, error)
            return
        if self.streams.get(stream.id) is not stream:
            return  # reset by the client meanwhile
        size = len(data)
        if size <= self.send_window and size <= stream.send_window and size <= self.max_send_frame:
            self.send_window -= size
            self._write(frame(HEADERS, END_HEADERS, stream.id, RESPONSE_HEADERS) + frame(DATA, 0, stream.id, data) +
                        frame(HEADERS, END_HEADERS | END_STREAM, stream.id, OK_TRAILERS))
            self._forget(stream)
            return
        self._write(frame(HEADERS, END_HEADERS, stream.id, RESPONSE_HEADERS))
        stream.outgoing = memoryview(data)
        self._send_data(stream)

    def _send_data(self, stream: _Stream) -> None:
        """As much of the stream's answer as the windows allow, and its trailers once all is sent."""
        outgoing = stream.outgoing
        while outgoing:
            size = min(len(outgoing), self.send_window, stream.send_window, self.max_send_frame)
            if size <= 0:
                self.blocked[stream.id] = stream
                stream.outgoing = outgoing
                return
            self._write(frame(DATA, 0, stream.id, bytes(outgoing[:size])))
            outgoing = outgoing[size:]
            self.send_window -= size
            stream.send_window -= size
        self._write(frame(HEADERS, END_HEADERS | END_STREAM, stream.id, OK_TRAILERS))
        self._forget(stream)

    def _flush_blocked(self) -> None:
        blocked, self.blocked = self.blocked, {}
        for stream in blocked.values():
            if self.transport is not None:
                self._send_data(stream)

    def _answer_status(self, stream: _Stream, code: grpc.StatusCode, message: str, then: bytes = b"") -> None:
        """A trailers-only answer: the call failed with `code`; `then`, frames to send after it."""
        if self.streams.get(stream.id) is stream:
            self._write(frame(HEADERS, END_HEADERS | END_STREAM, stream.id,
                              RESPONSE_HEADERS + status_block(code, message)) + then)
            self._forget(stream)

    def _refuse(self, stream: _Stream, code: grpc.StatusCode, message: str) -> None:
        """Answer the failure before the call starts, and tell the client to send no more of its request."""
        self._answer_status(stream, code, message, frame(RST_STREAM, 0, stream.id, NO_ERROR.to_bytes(4, "big")))

    def _forget(self, stream: _Stream) -> None:
        """The stream's call is over (answered, refused or reset). With no other call open the connection's frames
        are sent at once: there is no other answer to wait for in this turn."""
        self.streams.pop(stream.id, None)
        self.blocked.pop(stream.id, None)
        if not self.streams:
            if self.going_away:
                self._close()
            else:
                self._flush()
