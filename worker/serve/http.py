"""A small HTTP/1.1 server for the inference data plane: an asyncio Protocol over httptools' C parser.

Why not a web framework: per request, aiohttp's machinery (request and response objects, routing,
middleware, one task per request) cost about three times the CPU of this protocol on the same event loop,
and on a CPU-bound inference server that CPU comes straight out of the model's forward passes (measured in
bench/RESULTS.md). What it does, and all it does:

- keep-alive and pipelining (requests on one connection are answered in order, one at a time; reading
  pauses while too many wait), HTTP/1.0 and `Connection: close`;
- bodies by Content-Length or chunked, `Expect: 100-continue`, gzip/deflate request bodies, a body size
  limit (413 at once, then the connection closes), malformed requests (400, then close);
- back-pressure from slow readers (reading pauses while the write buffer is full), idle keep-alive
  connections closed after a timeout, and a graceful close that lets answered-but-unwritten work finish.

The application gets a Request and answers it by calling `request.respond(...)` exactly once, now or later
on the event loop's thread; a handler may also return a coroutine, which runs as a task.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import unquote

import httptools

log = logging.getLogger(__name__)

MAX_HEADER_COUNT = 100
MAX_PIPELINED = 16  # requests parsed ahead of the one being answered before reading pauses
LINGER_SECONDS = 10.0  # after refusing a body, read and drop the rest for this long, so the client sees the answer
LINGER_BYTES = 64 << 20
REASONS = {status.value: status.phrase for status in HTTPStatus}


@dataclass(frozen=True)
class HandedOver:
    """Connections to `port` accepted by another process and handed over (a process group's supervisor,
    processes.py): the server listens on nothing and serves what its `adopt` is given."""

    port: int


Listen = int | HandedOver
"""Where a server listens: a port (0: any free port), or nowhere (HandedOver)."""


async def listen(protocol: Callable[[], asyncio.Protocol], host: str, port: Listen,
                 **options) -> asyncio.Server | None:
    """Serve `protocol` on host:port; None for HandedOver."""
    if isinstance(port, HandedOver):
        return None
    return await asyncio.get_running_loop().create_server(protocol, host, port, **options)


def port_of(server: asyncio.Server | None, port: Listen) -> int:
    """The port a server started by `listen` serves."""
    return port.port if isinstance(port, HandedOver) else server.sockets[0].getsockname()[1]


class Adoptions:
    """Connections accepted elsewhere (HandedOver), made a server's by `adopt`, each with `protocol(received)` on the
    running loop (`received`: what was read from it already); while `closing()` they are closed instead."""

    def __init__(self, protocol: Callable[[bytes], asyncio.Protocol], closing: Callable[[], bool]):
        self.protocol = protocol
        self.closing = closing
        self._starting: set[asyncio.Task] = set()  # held until started: the loop keeps only weak references

    def adopt(self, connection: socket.socket, received: bytes = b"") -> None:
        """Serve `connection`, whose first bytes (`received`) were read already (by the C front: native.py): the
        protocol is given them as it is connected, before anything read later."""
        if self.closing():
            connection.close()
            return
        task = asyncio.get_running_loop().create_task(self._start(connection, received))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _start(self, connection: socket.socket, received: bytes) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: self.protocol(received), connection)
        except OSError as error:  # the client left while it was handed over
            log.debug("a connection handed over ended before it was served: %s", error)
            connection.close()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (a dependency on Linux and macOS; measured in
    bench/RESULTS.md), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _status_line(status: int) -> bytes:
    return f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n".encode("latin-1")


_STATUS_LINES = {status: _status_line(status) for status in REASONS}
_HEADER_NAMES = {spelling: name for name in ("host", "content-length", "content-type", "content-encoding", "expect",
                                             "connection", "inference-header-content-length", "user-agent",
                                             "accept", "accept-encoding", "transfer-encoding", "authorization")
                 for spelling in (name.encode(), name.title().encode(), name.upper().encode())}


class Request:
    """One parsed request. `respond()` answers it; `on_abort`, if the application sets it, is called when the
    client goes away before the answer."""

    __slots__ = ("method", "path", "headers", "body", "keep_alive", "on_abort", "_connection", "_answered")

    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes, keep_alive: bool,
                 connection: _Connection):
        self.method = method
        self.path = path
        self.headers = headers
        """Lower-cased names; a repeated header keeps its last value."""
        self.body = body
        self.keep_alive = keep_alive
        self.on_abort: Callable[[], None] | None = None
        self._connection = connection
        self._answered = False

    def respond(self, status: int, body: bytes, content_type: str = "application/json",
                headers: dict[str, str] | None = None) -> None:
        if self._answered:
            return
        self._answered = True
        self._connection.answer(self, status, body, content_type, headers)


Handler = Callable[[Request], Awaitable[None] | None]


class HttpServer:
    """Serves `handler` on host:port. `max_body()` gives the current body limit in bytes."""

    def __init__(self, handler: Handler, max_body: Callable[[], int], *, idle_timeout: float = 75.0,
                 on_error: Callable[[Request, BaseException], None] | None = None):
        self.handler = handler
        self.max_body = max_body
        self.idle_timeout = idle_timeout
        self.on_error = on_error
        self.connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None
        self.closing = False
        self.adopt = Adoptions(lambda received: _Connection(self, received), lambda: self.closing).adopt

    async def start(self, host: str, port: Listen) -> int:
        """Listen on host:port, or nowhere (HandedOver: see `adopt`); the port."""
        self._server = await listen(lambda: _Connection(self), host, port, reuse_address=True, backlog=1024)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_idle())
        return port_of(self._server, port)

    async def start_unix(self, path: str) -> None:
        """Listen on a Unix socket at `path` instead (the private channel between a pod's server processes)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), path)
        self._sweeper = loop.create_task(self._sweep_idle())

    async def _sweep_idle(self) -> None:
        interval = max(0.5, min(10.0, self.idle_timeout / 4))
        while True:
            await asyncio.sleep(interval)
            deadline = time.monotonic() - self.idle_timeout
            for connection in list(self.connections):
                if connection.idle and connection.last_activity < deadline:
                    connection.close()

    async def close(self) -> None:
        """Stop listening and close every connection (answers already being written are flushed first)."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, hands them to the application one at a time, writes answers."""

    def __init__(self, server: HttpServer, received: bytes = b""):
        self.server = server
        self._received = received  # read from the connection before it came here (Adoptions.adopt)
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.current: Request | None = None
        self.waiting: deque[Request] = deque()
        self.last_activity = time.monotonic()
        self.closed = False
        self.reading_paused = False
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_count = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._limit = 0  # the body size limit, read once per message when its headers are complete
        self._refused = False  # the current message was answered early (body too large): drop the rest
        self._dropped = 0
        self._failed = False
        self._dispatching = False

    # -- asyncio.Protocol -----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        if self._received:
            received, self._received = self._received, b""
            self.data_received(received)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        for request in [self.current, *self.waiting]:
            if request is not None and request.on_abort is not None and not request._answered:
                try:
                    request.on_abort()
                except Exception:
                    log.exception("abort callback failed")
        self.current = None
        self.waiting.clear()

    def data_received(self, data: bytes) -> None:
        self.last_activity = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as error:
            if self._refused:
                self._abort()
            else:
                self._fail(400, f"malformed HTTP request: {error}")

    def pause_writing(self) -> None:
        self._pause_reading()

    def resume_writing(self) -> None:
        if len(self.waiting) < MAX_PIPELINED:
            self._resume_reading()

    # -- httptools callbacks -------------------------------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._headers[_HEADER_NAMES.get(name) or name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self._header_count > MAX_HEADER_COUNT:
            return self._refuse(431, f"more than {MAX_HEADER_COUNT} headers")
        length = self._headers.get("content-length")
        limit = self._limit = self.server.max_body()
        if length is not None and length.isdigit() and int(length) > limit:
            return self._refuse(413, f"request body too large: {length} bytes; the limit is {limit} bytes")
        if self._headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    def on_body(self, body: bytes) -> None:
        if self._refused:
            self._dropped += len(body)
            if self._dropped > LINGER_BYTES:
                self._abort()
            return
        self._body_size += len(body)
        if self._body_size > self._limit:
            self._refuse(413, f"request body too large: over {self._limit} bytes")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._refused:
            self.close()
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        headers = self._headers
        # The next message starts empty (state reset here rather than in an on_message_begin callback: one call
        # from the parser fewer per request; a message refused or failed ends the connection instead).
        self._body = []
        self._headers = {}
        self._header_count = 0
        self._body_size = 0
        encoding = headers.get("content-encoding")
        if encoding and encoding != "identity":
            try:
                body = decompress(body, encoding, self._limit)
            except DecompressError as error:
                return self._fail(error.status, str(error))
        url, self._url = self._url, b""
        if b"?" in url or b"%" in url or b"#" in url or not url.startswith(b"/"):
            path = unquote(httptools.parse_url(url).path.decode("latin-1")) if url else "/"
        else:
            path = url.decode("latin-1")
        request = Request(self.parser.get_method().decode("latin-1"), path, headers, body,
                          self.parser.should_keep_alive(), self)
        self.waiting.append(request)
        if len(self.waiting) >= MAX_PIPELINED:
            self._pause_reading()
        self._next()
        return None

    # -- answering ----------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return self.current is None and not self.waiting

    def _next(self) -> None:
        """Hand waiting requests to the application, one at a time, in order. A loop, not recursion: handlers
        that answer at once would otherwise nest one call per pipelined request."""
        if self._dispatching:
            return
        self._dispatching = True
        try:
            while self.current is None and self.waiting and not self.closed:
                if self.reading_paused and len(self.waiting) <= MAX_PIPELINED // 2:
                    self._resume_reading()
                self._dispatch(self.waiting.popleft())
        finally:
            self._dispatching = False

    def _dispatch(self, request: Request) -> None:
        self.current = request
        server = self.server
        try:
            pending = server.handler(request)
        except Exception as error:
            self._crashed(request, error)
            return
        if pending is not None:
            task = asyncio.get_running_loop().create_task(pending)
            task.add_done_callback(lambda done: self._task_done(request, done))

    def _task_done(self, request: Request, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._crashed(request, task.exception())

    def _crashed(self, request: Request, error: BaseException) -> None:
        if self.server.on_error is not None:
            self.server.on_error(request, error)
        else:
            log.error("unexpected error serving %s %s", request.method, request.path, exc_info=error)
        request.respond(500, _error_body(f"internal error: {type(error).__name__}: {error}"))

    def answer(self, request: Request, status: int, body: bytes, content_type: str,
               headers: dict[str, str] | None) -> None:
        if self.closed or request is not self.current:
            return
        keep_alive = request.keep_alive and not self.server.closing
        length = b"%d" % len(body)
        if request.method == "HEAD":
            body = b""
        head = _STATUS_LINES.get(status) or _status_line(status)
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode("latin-1") \
            if headers else b""
        self.transport.write(b"".join((
            head, b"Content-Type: ", content_type.encode("latin-1"), b"\r\nContent-Length: ", length,
            b"\r\n", extra, b"" if keep_alive else b"Connection: close\r\n", b"\r\n", body)))
        self.current = None
        self.last_activity = time.monotonic()
        if not keep_alive:
            self.close()
            return
        if self.waiting:
            self._next()

    def _refuse(self, status: int, message: str) -> None:
        """Answer the message being received at once, then read and drop the rest of it before closing: closing
        while the client still sends would reset the connection and lose the answer (a "lingering close")."""
        self._refused = True
        self._fail(status, message, linger=True)

    def _fail(self, status: int, message: str, linger: bool = False) -> None:
        """Answer with an error and close the connection: after a parse error it cannot be trusted."""
        if self.closed or self.transport is None or self._failed:
            return
        self._failed = True
        for request in [self.current, *self.waiting]:  # earlier requests lose their turn: the stream is broken
            if request is not None and request.on_abort is not None and not request._answered:
                request.on_abort()
        self.current = None
        self.waiting.clear()
        body = _error_body(message)
        self.transport.write(f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: application/json"
                             f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode("latin-1") + body)
        if linger:
            asyncio.get_running_loop().call_later(LINGER_SECONDS, self._abort)
        else:
            self.close()

    def _abort(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()  # writes what is buffered, then closes

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()


class DecompressError(ValueError):
    """A compressed body that cannot be taken, with the HTTP status that says why: 415 (an encoding other than gzip
    and deflate), 400 (data that does not decompress) or 413 (larger than the limit once decompressed)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def decompress(body: bytes, encoding: str, limit: int, what: str = "request body") -> bytes:
    """`body` compressed with `encoding` (gzip or deflate: HTTP's Content-Encoding, gRPC's grpc-encoding), at most
    `limit` bytes once decompressed (a small bomb is refused without inflating it whole); `what` names it in errors."""
    encoding = encoding.strip().lower()
    if encoding == "gzip":
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif encoding == "deflate":
        decoder = zlib.decompressobj()
    else:
        raise DecompressError(f"{what} compressed with {encoding!r}, which is not supported; use gzip, deflate or "
                              "none (identity)", 415)
    try:
        data = decoder.decompress(body, limit + 1)
    except zlib.error as error:
        raise DecompressError(f"the {encoding} {what} cannot be decompressed: {error}", 400) from None
    if len(data) > limit:
        raise DecompressError(f"{what} too large: over {limit} bytes once decompressed", 413)
    return data


def _error_body(message: str) -> bytes:
    import orjson

    return orjson.dumps({"error": message})
