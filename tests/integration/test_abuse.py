"""The serving fronts under abuse, as an attacker would try them on loopback: a `tandem serve` process per front (the
C front, the default, and the Python one), each attack on its own connections while a legitimate client beside it
sends HTTP and gRPC inference requests. Every row asserts outcomes: the server is still up, the legitimate client
had every request answered, the attacking connection was closed (or its request refused) with the right code, and
the server's memory grew by less than a stated bound. The idle timeout is short here (--idle-timeout 1), which also
bounds the head and body timeouts (worker/serve/limits.py): every attack that holds a connection open ends within
it, so the rows take a second each rather than the minute a default server would give them."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from h2_frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    answer_headers,
    frame,
    frames_in,
    goaway_code,
    grpc_headers,
    grpc_message,
    header_block,
    hello,
    read_until_closed,
    rst_stream,
)
from serving import WAIT_S, inputs, json_body, make_pool, ports_from_log, serve_process, skip_without_c_front

from tandem.worker.serve.limits import MIB

IDLE_TIMEOUT_S = 1
CLOSED_WITHIN_S = 30  # a socket read's bound: an attacking connection must be closed long before it
RSS_BOUND = 64 * MIB  # Limits().connection_buffer_bytes: what one connection may hold at most
INFER = "/v2/models/digits/infer"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


class Served:
    def __init__(self, front: str, process, http_port: int, grpc_port: int):
        self.front = front
        self.process = process
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.log: list[str] = []

    def rss(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def connect(self, port: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=CLOSED_WITHIN_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


@pytest.fixture(scope="module", params=["native", "python"])
def served(request, tmp_path_factory) -> Iterator[Served]:
    skip_without_c_front(request.param)
    manifest = tmp_path_factory.mktemp("abuse") / "pool.json"
    manifest.write_text(json.dumps(make_pool(workersPerReplica=1, httpFront=request.param).to_dict()))
    process = serve_process(manifest, "--idle-timeout", str(IDLE_TIMEOUT_S))
    try:
        http_port, grpc_port = ports_from_log(process)
        server = Served(request.param, process, http_port, grpc_port)
        threading.Thread(target=lambda: server.log.extend(process.stderr), daemon=True).start()
        deadline = time.monotonic() + WAIT_S
        while _status(http_port, "GET", "/v2/health/ready") != 200:
            assert time.monotonic() < deadline and process.poll() is None, "".join(server.log)
            time.sleep(0.1)
        yield server
    finally:
        process.terminate()
        process.wait(WAIT_S)


def _status(port: int, method: str, path: str, body: bytes | None = None) -> int | None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        return connection.getresponse().status
    except OSError:
        return None
    finally:
        connection.close()


class Legitimate:
    """A client beside the attack: HTTP and gRPC inference requests one after the other until stopped."""

    def __init__(self, served: Served):
        self.served = served
        self.answered = self.failed = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        x = inputs(1)
        client = tgrpc.InferenceServerClient(f"127.0.0.1:{self.served.grpc_port}")
        try:
            while not self._stop.is_set() or self.answered < 4:
                self._one(lambda: _status(self.served.http_port, "POST", INFER, json_body(x)) == 200, "HTTP")
                self._one(lambda: self._grpc(client, x), "gRPC")
        finally:
            client.close()

    @staticmethod
    def _grpc(client, x: np.ndarray) -> bool:
        tensor = tgrpc.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer("digits", [tensor], client_timeout=WAIT_S).as_numpy("output").shape == (1, 10)

    def _one(self, call: Callable[[], bool], what: str) -> None:
        try:
            ok = call()
        except Exception as error:  # noqa: BLE001 - every failure is counted and shown
            ok, what = False, f"{what}: {error}"
        if ok:
            self.answered += 1
        else:
            self.failed += 1
            self.failures.append(what)

    def __enter__(self) -> Legitimate:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)


@contextmanager
def attack(served: Served, rss_bound: int = RSS_BOUND) -> Iterator[None]:
    """The attack inside runs while a legitimate client is served beside it; afterwards the server is up, the
    client had every request answered, and the server's memory grew by less than `rss_bound` (measured while the
    attack's connections may still be open: the caller closes them after). With -s, a line for the abuse table in
    bench/RESULTS.md: the front, the attack, the legitimate client's answers, the server's RSS before and after."""
    before = served.rss()
    with Legitimate(served) as client:
        yield
        after = served.rss()
        grown = after - before
    print(f"\nABUSE | {served.front} | {os.environ.get('PYTEST_CURRENT_TEST', '').split('::')[-1].split(' ')[0]} | "
          f"{client.answered}/{client.answered + client.failed} | {before / MIB:.0f} -> {after / MIB:.0f} MiB")
    assert served.process.poll() is None, "".join(served.log[-40:])
    assert client.failed == 0 and client.answered >= 4, client.failures[:5]
    assert grown < rss_bound, f"the server grew by {grown / MIB:.1f} MiB under attack"


# -- memory ---------------------------------------------------------------------------------------------------

def test_unfinished_large_grpc_messages_hold_a_bounded_amount_of_memory(served):
    """Eight calls on one connection, each sending a 40 MiB message it never finishes, paying no attention to the
    windows (the issue's 320 MiB): flow control stops the client, or the connection ends for breaching it."""
    sock = served.connect(served.grpc_port)
    chunk = b"\0" * (16 << 10)
    with attack(served):
        sent = bytearray(hello())
        for stream in range(1, 17, 2):
            sent += frame(HEADERS, END_HEADERS, stream, header_block(grpc_headers(MODEL_INFER)))
        sock.sendall(bytes(sent))
        sock.settimeout(2.0)
        try:
            for _ in range(40 * 64):
                for stream in range(1, 17, 2):
                    sock.sendall(frame(DATA, 0, stream, chunk))
        except OSError:
            pass  # the server stopped reading (flow control) or closed the connection
    sock.close()


def test_many_large_http_bodies_are_refused_before_they_are_held(served):
    """Eight connections each announcing a 40 MiB JSON body: 413 at once, nothing of it held."""
    socks = [served.connect(served.http_port) for _ in range(8)]
    with attack(served):
        for sock in socks:
            sock.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {40 << 20}\r\n\r\n".encode() + b"[" * 4096)
        for sock in socks:
            assert sock.recv(64).startswith(b"HTTP/1.1 413")
    for sock in socks:
        sock.close()


# -- time ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opening", [b"", PREFACE[:10], hello(),
                                     hello() + frame(HEADERS, END_HEADERS, 1, header_block(grpc_headers()))],
                         ids=["nothing", "half a preface", "a preface and no call", "a call never finished"])
def test_a_grpc_connection_that_holds_without_finishing_is_closed(served, opening):
    sock = served.connect(served.grpc_port)
    with attack(served):
        sock.sendall(opening)
        read_until_closed(sock)
    sock.close()


@pytest.mark.parametrize("opening", [b"", f"POST {INFER} HTTP/1.1\r\nHost: x\r\n".encode(),
                                     f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n[".encode()],
                         ids=["nothing", "half a head (slowloris)", "half a body"])
def test_an_http_connection_that_holds_without_finishing_is_closed(served, opening):
    sock = served.connect(served.http_port)
    with attack(served):
        sock.sendall(opening)
        received = read_until_closed(sock)
    assert received == b"" or received.startswith(b"HTTP/1.1 408"), received[:100]
    sock.close()


# -- floods ---------------------------------------------------------------------------------------------------

def _flood(served: Served, opening: bytes, unit: Callable[[int], bytes], count: int, read: bool = True) -> bytes:
    """Sends `opening`, then `unit(i)` for i in range(count) in large writes (stopping when the server closes or
    stops reading), then reads until the server closes the connection (unless `read` is False): what it sent."""
    sock = served.connect(served.grpc_port)
    sock.settimeout(5.0)
    try:
        sock.sendall(opening)
        batch = 500
        for start in range(0, count, batch):
            sock.sendall(b"".join(unit(i) for i in range(start, min(count, start + batch))))
    except OSError:
        pass
    sock.settimeout(CLOSED_WITHIN_S)
    try:
        return read_until_closed(sock) if read else b""
    finally:
        sock.close()


def test_a_rapid_reset_flood_ends_that_connection_and_others_are_served(served):
    """CVE-2023-44487: 20,000 calls each reset as soon as opened. libnghttp2 (the C front) ends the connection with
    GOAWAY ENHANCE_YOUR_CALM past its reset rate; grpc core (the Python front) takes the resets (it starts no call
    for a stream reset before its message) and the connection ends when it has been idle."""
    block = header_block(grpc_headers(MODEL_INFER))
    with attack(served):
        received = _flood(served, hello(), lambda i: frame(HEADERS, END_HEADERS, 2 * i + 1, block) +
                          rst_stream(2 * i + 1), 20_000)
    if served.front == "native":
        assert goaway_code(received) == ENHANCE_YOUR_CALM, received[-64:]


def test_a_continuation_flood_ends_that_connection_and_others_are_served(served):
    """CVE-2024-28182: one header block continued without end."""
    opening = hello() + frame(HEADERS, 0, 1, header_block(grpc_headers()))
    with attack(served):
        received = _flood(served, opening, lambda i: frame(CONTINUATION, 0, 1, header_block([(f"x-{i}", "y")])),
                          20_000)
    assert goaway_code(received) is not None or received == b"", received[-64:]


def test_a_ping_flood_whose_acks_are_never_read_ends_that_connection_and_others_are_served(served):
    with attack(served):
        _flood(served, hello(), lambda i: frame(PING, 0, 0, i.to_bytes(8, "big")), 200_000, read=False)


def test_a_settings_flood_ends_that_connection_and_others_are_served(served):
    with attack(served):
        _flood(served, hello(), lambda i: frame(SETTINGS, 0, 0), 100_000, read=False)


def test_a_client_that_pipelines_without_reading_does_not_starve_the_others(served):
    """40 MB of pipelined inference requests whose answers are never read."""
    one = f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
    body = json_body(inputs(1))
    request = one + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    sock = served.connect(served.http_port)
    sock.settimeout(5.0)
    with attack(served):
        try:
            for _ in range((40 << 20) // (len(request) * 100)):
                sock.sendall(request * 100)
        except OSError:
            pass  # the server stopped reading it
    sock.close()


# -- answers ---------------------------------------------------------------------------------------------------

def _post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            "\r\n\r\n").encode() + body


@pytest.mark.parametrize(("request_bytes", "status"), [
    (_post("/v2/models/digits%2Finfer", json_body(inputs(1))), 400),
    (b"GET /v2/health/ready\r\n\r\n", 400),
    (b"GET /v2/health/ready HTTP/1.1\r\n\r\n", 400),
    (_post(INFER, json_body(inputs(1))), 200),
    (_post(INFER, json_body(inputs(1))).replace(b"\r\n\r\n", b"\r\n\r"), 400),
    (_post(INFER, b'{"inputs":[{"name":"input","shape":[1,64],"datatype":"FP32","data":[1e39' +
           b',0' * 63 + b']}]}'), 400),
], ids=["an encoded slash", "HTTP/0.9", "no Host", "the same request, well formed",
        "a head ended by a CR alone (read two ways: smuggling)", "an FP32 value beyond float32"])
def test_what_the_rfcs_refuse_is_refused(served, request_bytes, status):
    sock = served.connect(served.http_port)
    sock.sendall(request_bytes)
    answer = sock.recv(4096)
    sock.close()
    assert answer.startswith(f"HTTP/1.1 {status}".encode()), answer[:200]


def test_grpc_timeout_zero_is_deadline_exceeded(served):
    sock = served.connect(served.grpc_port)
    sock.sendall(hello() + frame(HEADERS, END_HEADERS, 1, header_block(grpc_headers(**{"grpc-timeout": "0n"}))) +
                 frame(DATA, END_STREAM, 1, grpc_message(b"")))
    assert answer_headers(sock, 1).get("grpc-status") == "4"  # DEADLINE_EXCEEDED
    sock.close()


def _errors(received: bytes) -> list[tuple[str, int]]:
    """The GOAWAY and RST_STREAM frames in `received` with an error code."""
    named = {GOAWAY: "GOAWAY", RST_STREAM: "RST_STREAM"}
    return [(named[kind], int.from_bytes(payload[-4:] if kind == RST_STREAM else payload[4:8], "big"))
            for kind, _, _, payload in frames_in(received) if kind in named]


CALL = header_block(grpc_headers())
GRPC_CORE_TAKES = {"a connection-specific header", "WINDOW_UPDATE of 0"}


@pytest.mark.parametrize("breach", [
    frame(HEADERS, END_HEADERS | END_STREAM, 1, header_block([*grpc_headers(), ("X-Upper", "1")])),
    frame(HEADERS, END_HEADERS | END_STREAM, 1, header_block([*grpc_headers(), ("connection", "keep-alive")])),
    frame(WINDOW_UPDATE, 0, 0, (0).to_bytes(4, "big")),
    frame(DATA, 0, 5, b"x"),
    frame(RST_STREAM, 0, 7, (0).to_bytes(4, "big")),
    frame(HEADERS, END_HEADERS, 1, CALL) + frame(DATA, END_STREAM, 1, grpc_message(b"")) +
    frame(HEADERS, END_HEADERS, 1, CALL),
], ids=["an uppercase header", "a connection-specific header", "WINDOW_UPDATE of 0", "DATA on an idle stream",
        "RST_STREAM on an idle stream", "a stream id used again"])
def test_a_breach_of_rfc_9113_is_a_stream_or_connection_error(served, breach, request):
    """libnghttp2 (the C front) answers every one; grpc core (the Python front, the fallback) lets two pass, which
    is recorded here so that a change on either side is seen."""
    sock = served.connect(served.grpc_port)
    sock.sendall(hello() + breach)
    errors = [(kind, code) for kind, code in _errors(read_until_closed(sock)) if code != NO_ERROR]
    sock.close()
    if served.front == "python" and request.node.callspec.id.split("-", 1)[1] in GRPC_CORE_TAKES:
        assert not [error for error in errors if error[1] == PROTOCOL_ERROR]  # it ends when idle, as any other
    else:
        assert errors, "the breach was taken as if it were none"
