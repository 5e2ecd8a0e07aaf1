"""A small HTTP/1.1 server for the inference data plane: an asyncio Protocol over httptools' C parser.

Why not a web framework: per request, aiohttp's machinery (request and response objects, routing,
middleware, one task per request) cost about three times the CPU of this protocol on the same event loop,
and on a CPU-bound inference server that CPU comes straight out of the model's forward passes (measured in
bench/RESULTS.md). What it does, and all it does:

- keep-alive and pipelining (requests on one connection are answered in order, one at a time; reading
  pauses while too many wait), HTTP/1.0 and `Connection: close`;
- bodies by Content-Length or chunked, `Expect: 100-continue`, gzip/deflate request bodies, a body size
  limit (413 at once, then the connection closes), malformed requests (400, then close);
- strict where the RFCs are: HTTP/0.9, HTTP/1.1 without one Host, an encoded slash in the path (400, never decoded);
- bounded by the server's Limits (limits.py): head and body timeouts (408), max_head_bytes (431), idle connections
  closed, no request read from a client leaving over unsent_bytes of answers unread; a graceful close.

The application gets a Request and answers it by calling `request.respond(...)` exactly once, now or later
on the event loop's thread; a handler may also return a coroutine, which runs as a task.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from urllib.parse import unquote

import httptools

from tandem.worker.serve.compression import DecompressError, decompress
from tandem.worker.serve.limits import Limits
from tandem.worker.serve.processes import HandedOver, Listen

log = logging.getLogger(__name__)

MAX_HEADER_COUNT = 100
MAX_PIPELINED = 16  # requests parsed ahead of the one being answered before reading pauses
LINGER_SECONDS = 10.0  # after refusing a body, read and drop the rest for this long, so the client sees the answer
LINGER_BYTES = 64 << 20
REASONS = {status.value: status.phrase for status in HTTPStatus}
DEFAULT_LIMITS = Limits()


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
    """Serves `handler` on host:port. `max_body()` gives the current body limit in bytes; `limits` bound the rest."""

    def __init__(self, handler: Handler, max_body: Callable[[], int], *, limits: Limits = DEFAULT_LIMITS,
                 on_error: Callable[[Request, BaseException], None] | None = None):
        self.handler = handler
        self.max_body = max_body
        self.limits = limits
        self.on_error = on_error
        self.connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None
        self.closing = False
        self._starting: set[asyncio.Task] = set()  # adopted connections, held until started (see adopt)

    async def start(self, host: str, port: Listen) -> int:
        """Listen on host:port, or nowhere (HandedOver: see `adopt`); the port."""
        loop = asyncio.get_running_loop()
        self._sweeper = loop.create_task(self._sweep())
        if isinstance(port, HandedOver):
            return port.port
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True,
                                                backlog=1024)
        return self._server.sockets[0].getsockname()[1]

    async def start_unix(self, path: str) -> None:
        """Listen on a Unix socket at `path` instead (the private channel between a pod's server processes)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), path)
        self._sweeper = loop.create_task(self._sweep())

    def adopt(self, connection: socket.socket, received: bytes = b"") -> None:
        """Serve `connection`, accepted elsewhere (HandedOver), whose first bytes (`received`) were read already (by
        the C front: native.py): they are parsed as it is connected, before anything read later."""
        if self.closing:
            connection.close()
            return
        task = asyncio.get_running_loop().create_task(self._adopted(connection, received))
        self._starting.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._starting.discard)

    async def _adopted(self, connection: socket.socket, received: bytes) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: _Connection(self, received), connection)
        except OSError as error:  # the client left while it was handed over
            log.debug("a connection handed over ended before it was served: %s", error)
            connection.close()

    async def _sweep(self) -> None:
        """Close the connections past their timeouts: a request's head or body late (408), or nothing in flight."""
        limits = self.limits
        interval = min(10.0, max(0.05, min(limits.header_timeout_s, limits.body_timeout_s, limits.idle_timeout_s) / 4))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for connection in list(self.connections):
                late = connection.deadline is not None and connection.deadline < now and not connection.reading_paused
                if late:
                    connection.time_out()
                elif connection.idle and connection.last_activity < now - limits.idle_timeout_s:
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
        self.deadline: float | None = None  # the message being received must have arrived by then (None: none is)
        self._in_body = False  # it is its body that is awaited
        self.closed = False
        self.reading_paused = False
        self.writing_paused = False  # the client leaves more than unsent_bytes unread: its requests are not read
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_count = 0
        self._head_size = 0
        self._hosts = 0
        self._keep_alive = False
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
        transport.set_write_buffer_limits(high=self.server.limits.unsent_bytes)
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
        now = self.last_activity = time.monotonic()
        if self.deadline is None:  # the first byte of a message (or of what follows one in the bytes last read)
            self.deadline = now + self.server.limits.header_timeout_s
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
        self.writing_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self.writing_paused = False
        if len(self.waiting) < MAX_PIPELINED:
            self._resume_reading()

    # -- httptools callbacks -------------------------------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._head_size += len(name) + len(value)
        key = _HEADER_NAMES.get(name) or name.decode("latin-1").lower()
        if key == "host":
            self._hosts += 1
        self._headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self._header_count > MAX_HEADER_COUNT:
            return self._refuse(431, f"more than {MAX_HEADER_COUNT} headers")
        if self._head_size > self.server.limits.max_head_bytes:
            return self._refuse(431, f"the request's head is over {self.server.limits.max_head_bytes} bytes")
        self._keep_alive = self.parser.should_keep_alive()
        if self._hosts != 1 or not self._keep_alive:  # HTTP/0.9 is never kept alive
            version = self.parser.get_http_version()
            if version == "0.9":
                return self._refuse(400, "an HTTP/0.9 request line (no HTTP version) is not served: send "
                                         "<METHOD> <path> HTTP/1.1, with a Host header")
            if self._hosts > 1 or (self._hosts == 0 and version == "1.1"):
                return self._refuse(400, f"an HTTP/1.1 request needs one Host header (RFC 9112 3.2); it has "
                                         f"{self._hosts}: send Host: <the server's host>")
        self.deadline, self._in_body = self.last_activity + self.server.limits.body_timeout_s, True
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
        self._header_count = self._head_size = self._hosts = self._body_size = 0
        self.deadline, self._in_body = None, False
        encoding = headers.get("content-encoding")
        if encoding and encoding != "identity":
            try:
                body = decompress(body, encoding, self._limit)
            except DecompressError as error:
                return self._fail(error.status, str(error))
        url, self._url = self._url, b""
        if b"?" in url or b"%" in url or b"#" in url or not url.startswith(b"/"):
            path = httptools.parse_url(url).path.decode("latin-1") if url else "/"
            if "%2f" in path.lower():  # refused, never decoded: a proxy's path rules would read another path
                return self._fail(400, f"the path {path!r} has an encoded slash (%2F) in a segment, which is "
                                       "refused rather than decoded: send the path with plain slashes")
            path = unquote(path)
        else:
            path = url.decode("latin-1")
        request = Request(self.parser.get_method().decode("latin-1"), path, headers, body, self._keep_alive, self)
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

    def time_out(self) -> None:
        """The message being received is late: 408 where no answer is owed before it, then close."""
        limits = self.server.limits
        if self.idle:
            self._fail(408, f"the request's body did not arrive within {limits.body_timeout_s:g} s of its head"
                       if self._in_body else f"the request's head did not arrive within {limits.header_timeout_s:g} "
                       "s of its first byte")
        self.close()

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.reading_paused and not self.writing_paused and self.transport is not None and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()
            if self.deadline is not None:  # what was not read while paused is not the client's delay
                limits = self.server.limits
                self.deadline = time.monotonic() + (limits.body_timeout_s if self._in_body else limits.header_timeout_s)


def _error_body(message: str) -> bytes:
    import orjson

    return orjson.dumps({"error": message})
