"""The HTTP/1.1 layer under the inference server, over raw sockets on 127.0.0.1: keep-alive, pipelining,
chunked and compressed bodies, Expect: 100-continue, body limits, malformed requests, idle connections, and a
client that goes away mid-request. Bounded waits only; no timed assertions."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading

import pytest
from inference_models import GATES
from serving import WAIT_S, Servers, gated_pool, inputs, json_body, wait_until

from tandem.worker.serve.http import HttpServer, Request
from tandem.worker.serve.limits import Limits

LIMIT = 1000


class EchoServer:
    """HttpServer on a background event loop; its handler answers `METHOD PATH BODY`, or later for /slow."""

    def __init__(self, limits: Limits | None = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.held: list[Request] = []
        self.http = HttpServer(self.handle, lambda: LIMIT, limits=limits or Limits())
        self.port = asyncio.run_coroutine_threadsafe(self.http.start("127.0.0.1", 0), self.loop).result(WAIT_S)

    def handle(self, request: Request):
        if request.path == "/slow":
            self.held.append(request)
            return None
        if request.path == "/async":
            return self.later(request)
        if request.path == "/crash":
            raise RuntimeError("boom")
        request.respond(200, f"{request.method} {request.path} {request.body.decode()}".encode(), "text/plain")
        return None

    async def later(self, request: Request) -> None:
        await asyncio.sleep(0)
        request.respond(200, b"later", "text/plain")

    def release(self) -> None:
        def answer():
            for request in self.held:
                request.respond(200, b"slow done", "text/plain")
            self.held.clear()
        self.loop.call_soon_threadsafe(answer)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.http.close(), self.loop).result(WAIT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)


@pytest.fixture
def echo():
    server = EchoServer()
    yield server
    server.close()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)


def read_response(sock: socket.socket, buffer: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response from `sock` (`buffer` keeps bytes read past it)."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before a response")
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed mid-response")
        rest += chunk
    buffer[:] = rest[length:]
    return status, headers, rest[:length]


def read_response_to_head(sock: socket.socket, buffer: bytearray) -> tuple[int, dict[str, str], bytes]:
    """A response to HEAD: headers only, whatever Content-Length says."""
    while b"\r\n\r\n" not in buffer:
        buffer += sock.recv(65536)
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    buffer[:] = rest
    lines = head.decode("latin-1").split("\r\n")
    return int(lines[0].split()[1]), {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}, b""


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_keep_alive_and_pipelined_requests_are_answered_in_order(echo):
    sock, buffer = connect(echo.port), bytearray()
    sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_response(sock, buffer)[2] == b"GET /a "
    sock.sendall(b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
                 b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                 b"GET /async HTTP/1.1\r\nHost: x\r\n\r\n"
                 b"GET /c%20d HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_response(sock, buffer)[2] == b"POST /b hi"
    wait_until(lambda: len(echo.held) == 1, what="the slow request held")
    echo.release()
    assert read_response(sock, buffer)[2] == b"slow done"
    assert read_response(sock, buffer)[2] == b"later"
    assert read_response(sock, buffer)[2] == b"GET /c d "
    sock.close()


def test_a_thousand_and_more_pipelined_requests_in_one_write_are_answered_in_order(echo):
    sock, buffer = connect(echo.port), bytearray()
    sock.sendall(b"".join(b"GET /r%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(1500)))
    for i in range(1500):
        assert read_response(sock, buffer)[2] == b"GET /r%d " % i
    sock.sendall(b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\nGET /after HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = read_response_to_head(sock, buffer)
    assert (status, headers["content-length"], body) == (200, "8", b"")
    assert read_response(sock, buffer)[2] == b"GET /after "
    sock.close()


def test_chunked_bodies_expect_100_continue_and_gzip(echo):
    sock, buffer = connect(echo.port), bytearray()
    sock.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    assert read_response(sock, buffer)[2] == b"POST /x abcde"
    sock.sendall(b"POST /y HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    assert read_response(sock, buffer)[0] == 100
    sock.sendall(b"body")
    assert read_response(sock, buffer)[2] == b"POST /y body"
    packed = gzip.compress(b"unzipped")
    sock.sendall(b"POST /z HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(packed)
                 + packed)
    assert read_response(sock, buffer)[2] == b"POST /z unzipped"
    sock.close()


@pytest.mark.parametrize(("request_bytes", "status", "words"), [
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "malformed HTTP request"),
    (b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000, 413,
     "5000 bytes; the limit is 1000"),
    (b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"3e8\r\n" + b"x" * 1000 + b"\r\n"
     + b"3e8\r\n" + b"x" * 1000 + b"\r\n0\r\n\r\n", 413, "over 1000 bytes"),
    (b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 5\r\n\r\nnope!", 400,
     "cannot be decompressed"),
    (b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\nContent-Length: 1\r\n\r\nx", 415,
     "'br', which is not supported"),
    (b"GET /crash HTTP/1.1\r\nHost: x\r\n\r\n", 500, "internal error: RuntimeError: boom"),
    # strict where the RFCs are
    (b"GET /a\r\n\r\n", 400, "HTTP/0.9 request line"),
    (b"GET /a\r\nHost: x\r\n\r\n", 400, "HTTP/0.9 request line"),
    (b"GET /a HTTP/1.1\r\n\r\n", 400, "needs one Host header"),
    (b"GET /a HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400, "needs one Host header"),
    (b"GET /v2/models/a%2Finfer HTTP/1.1\r\nHost: x\r\n\r\n", 400, "encoded slash (%2F) in a segment"),
    (b"GET /v2/models/a%2finfer?x=1 HTTP/1.1\r\nHost: x\r\n\r\n", 400, "send the path with plain slashes"),
    (b"GET /a HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 20_000 + b"\r\n\r\n", 431, "head is over 16384 bytes"),
])
def test_bad_requests_are_answered_with_a_json_error(echo, request_bytes, status, words):
    sock, buffer = connect(echo.port), bytearray()
    sock.sendall(request_bytes)
    got, headers, body = read_response(sock, buffer)
    assert (got, words in json.loads(body)["error"]) == (status, True), body
    if status != 500:
        assert headers["connection"] == "close" and closed_by_server(sock)
    sock.close()


def test_a_gzip_bomb_is_refused_by_its_decompressed_size(echo):
    packed = gzip.compress(b"0" * 100_000)
    sock, buffer = connect(echo.port), bytearray()
    sock.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(packed)
                 + packed)
    status, _, body = read_response(sock, buffer)
    assert status == 413 and "once decompressed" in json.loads(body)["error"]
    sock.close()


def test_http_1_0_and_connection_close_end_the_connection(echo):
    for request_line in (b"GET /a HTTP/1.0\r\n\r\n", b"GET /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"):
        sock, buffer = connect(echo.port), bytearray()
        sock.sendall(request_line)
        status, headers, _ = read_response(sock, buffer)
        assert status == 200 and headers["connection"] == "close" and closed_by_server(sock)
        sock.close()


def test_idle_keep_alive_connections_are_closed():
    server = EchoServer(Limits(idle_timeout_s=0.2))
    try:
        sock, buffer = connect(server.port), bytearray()
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        read_response(sock, buffer)
        assert closed_by_server(sock)  # recv blocks (up to WAIT_S) until the sweeper closes it
        sock.close()
    finally:
        server.close()


def test_http_1_0_without_host_is_served(echo):
    sock, buffer = connect(echo.port), bytearray()
    sock.sendall(b"GET /a%20b HTTP/1.0\r\n\r\n")
    assert read_response(sock, buffer)[:3:2] == (200, b"GET /a b ")
    sock.close()


@pytest.mark.parametrize(("sent", "late"), [
    (b"GET /a HTTP/1.1\r\nHost: x\r\n", "head did not arrive within 0.3 s of its first byte"),
    (b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12", "body did not arrive within 0.3 s of its head"),
])
def test_a_slowloris_client_is_answered_408_and_closed(sent, late):
    """A client that sends its request a byte at a time, never finishing it: each byte keeps it from being idle, but
    its head (or body) is late all the same."""
    server = EchoServer(Limits(header_timeout_s=0.3, body_timeout_s=0.3))
    stop = threading.Event()
    try:
        sock, buffer = connect(server.port), bytearray()
        sock.sendall(sent)

        def trickle() -> None:
            while not stop.wait(0.05):
                try:
                    sock.send(b"X" if b"Content-Length" not in sent else b"3")
                except OSError:
                    return
        threading.Thread(target=trickle, daemon=True).start()
        status, headers, body = read_response(sock, buffer)
        assert (status, headers["connection"], json.loads(body)["error"]) == (408, "close", f"the request's {late}")
        assert closed_by_server(sock)
        sock.close()
    finally:
        stop.set()
        server.close()


def test_a_client_that_pipelines_and_never_reads_is_not_read_and_others_are_served():
    """Its answers pile up unread to unsent_bytes, then its requests are no longer read (before, reading resumed as
    soon as its queue of requests drained, and its answers grew without bound); another client is served meanwhile."""
    unsent = 64 << 10
    server = EchoServer(Limits(unsent_bytes=unsent))
    try:
        greedy = connect(server.port)
        # A receive buffer of a few loopback segments (64 KiB each), not less: below one segment both kernels fall
        # into zero-window probing with exponential backoff, and the flood stalls for tens of seconds at a time.
        greedy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 18)
        flood = b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n" * 1000
        sender = threading.Thread(target=lambda: _send_until_refused(greedy, flood, 400), daemon=True)
        sender.start()
        other, buffer = connect(server.port), bytearray()
        for i in range(20):
            other.sendall(b"GET /o%d HTTP/1.1\r\nHost: x\r\n\r\n" % i)
            assert read_response(other, buffer)[2] == b"GET /o%d " % i
        other.close()

        def held() -> list:
            return [c for c in server.http.connections if c.writing_paused and c.reading_paused]
        wait_until(lambda: held(), what="the greedy client no longer read")
        [connection] = held()
        # what is buffered for it: at most unsent_bytes, and the answers to the requests of one read past it
        assert connection.transport.get_write_buffer_size() < unsent + (1 << 20)
        greedy.shutdown(socket.SHUT_RDWR)  # wakes the sender blocked in sendall
        greedy.close()
        sender.join(WAIT_S)
        assert not sender.is_alive()
    finally:
        server.close()


def _send_until_refused(sock: socket.socket, data: bytes, times: int) -> None:
    try:
        for _ in range(times):
            sock.sendall(data)
    except OSError:
        pass


def test_a_client_that_goes_away_withdraws_its_queued_request():
    name = "goes-away"
    with Servers() as servers:
        server = servers(gated_pool(name, workersPerReplica=1))
        gate, inference = GATES[name], server.server.model.inference
        gate.close()
        body = json_body(inputs(1))
        request = b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (name.encode(),
                                                                                               len(body))
        running = connect(server.port)
        running.sendall(request + body)
        gate.wait_entered(1)
        leaving = connect(server.port)
        leaving.sendall(request + body)
        wait_until(lambda: inference.queued == 1, what="a queued request")
        leaving.close()
        wait_until(lambda: inference.queued == 0, what="the request withdrawn")
        gate.open.set()
        status, _, _ = read_response(running, bytearray())
        assert status == 200
        running.close()
        wait_until(lambda: server.server.pending.count == 0, what="nothing in flight")
        again = connect(server.port)  # and the server still answers
        again.sendall(request + body)
        assert read_response(again, bytearray())[0] == 200
        again.close()
