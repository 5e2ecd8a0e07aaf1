"""The C front's gRPC side (worker/serve/_front_grpc.c) over real sockets on 127.0.0.1, driven by a hand-framed
HTTP/2 client (hpack's encoder: Huffman coding, the dynamic table, its size updates, header blocks continued over
CONTINUATION frames, padding, DATA split over frames, the request's end in trailers): what the front answers itself
must be what the Python server answers, and every call it does not take must reach the Python server intact.
test_grpc.py and test_grpc_server.py run whole under both fronts too (tritonclient.grpc and grpcio as clients)."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import zlib

import hpack
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from google.protobuf.message import DecodeError
from h2_frames import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    PREFACE,
    PROTOCOL_ERROR,
    RST_STREAM,
    SETTINGS,
    frame,
    goaway_code,
    header_block,
    hello,
    read_until_closed,
    rst_stream,
)
from serving import WAIT_S, Servers, inputs, needs_c_front, reference
from tritonclient.grpc import service_pb2

from tandem.worker.serve.limits import Limits

pytestmark = needs_c_front

INFER = "/inference.GRPCInferenceService/ModelInfer"
PADDED = 0x8
MAX_CONTINUATIONS = Limits().max_continuations
FUZZ_CASES = 150


class Client:
    """One HTTP/2 connection, framed by hand; `call` sends a unary call in the way asked and reads its answer."""

    def __init__(self, port: int | None = None, sock: socket.socket | None = None):
        self.sock = sock or socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0, b""))
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.received = b""
        self.events: dict[int, list] = {}  # frames read for each stream, header blocks decoded in the order read
        self.stream = 1

    def close(self) -> None:
        self.sock.close()

    def call(self, headers: list[tuple[str, str]], body: bytes, rng: random.Random | None = None):
        """The answer: ("answer", headers and trailers as a dict, DATA), ("reset", code) or ("goaway", code). With
        `rng`, the call is framed in one of the many ways HTTP/2 allows (see the module's docstring); without, as
        plainly as it can be (one HEADERS, one DATA)."""
        rng = rng or _Plain()
        stream, self.stream = self.stream, self.stream + 2
        if rng.random() < 0.2:
            self.encoder.header_table_size = rng.choice([0, 256, 4096])
        block = self.encoder.encode(headers, huffman=rng.random() < 0.5)
        in_trailers = rng.random() < 0.2  # the request ends with a HEADERS frame after its DATA
        cut = rng.randrange(len(block) + 1) if rng.random() < 0.3 else len(block)
        first, rest = block[:cut], block[cut:]
        frames = self._padded(HEADERS, END_HEADERS * (not rest) | END_STREAM * (not body and not in_trailers), stream,
                              first, rng)
        continuations = 0
        while rest:  # in at most MAX_CONTINUATIONS frames (Limits.max_continuations: more is a flood)
            continuations += 1
            size = rng.randint(-(-len(rest) // (MAX_CONTINUATIONS + 1 - continuations)), len(rest))
            piece, rest = rest[:size], rest[size:]
            frames += frame(CONTINUATION, END_HEADERS * (not rest), stream, piece)
        offset = 0
        while offset < len(body):
            piece = body[offset:offset + rng.choice([len(body), 7, 1000, 16000])]
            offset += len(piece)
            frames += self._padded(DATA, END_STREAM * (offset >= len(body) and not in_trailers), stream, piece, rng)
        if in_trailers:
            frames += frame(HEADERS, END_HEADERS | END_STREAM, stream, self.encoder.encode([("x-end", "1")]))
        self.sock.sendall(frames)
        return self._answer(stream)

    @staticmethod
    def _padded(kind: int, flags: int, stream: int, payload: bytes, rng: random.Random) -> bytes:
        if rng.random() < 0.2:
            padding = rng.randrange(20)
            return frame(kind, flags | PADDED, stream, bytes((padding,)) + payload + b"\0" * padding)
        return frame(kind, flags, stream, payload)

    def _read_frame(self) -> bool:
        while len(self.received) < 9 or len(self.received) < 9 + int.from_bytes(self.received[:3], "big"):
            chunk = self.sock.recv(65536)
            if not chunk:
                return False
            self.received += chunk
        length = int.from_bytes(self.received[:3], "big")
        kind, flags = self.received[3], self.received[4]
        on = int.from_bytes(self.received[5:9], "big")
        payload, self.received = self.received[9:9 + length], self.received[9 + length:]
        if kind == HEADERS:
            payload = dict(self.decoder.decode(payload))
        elif kind == SETTINGS and not flags & ACK:
            self.sock.sendall(frame(SETTINGS, ACK, 0, b""))
        self.events.setdefault(on, []).append((kind, flags, payload))
        return True

    def _answer(self, stream: int):
        fields, data = {}, b""
        while True:
            goaway = [payload for kind, _, payload in self.events.get(0, []) if kind == GOAWAY]
            if goaway:
                return ("goaway", int.from_bytes(goaway[0][4:8], "big"))
            events = self.events.pop(stream, [])
            for kind, flags, payload in events:
                if kind == RST_STREAM:
                    return ("reset", int.from_bytes(payload, "big"))
                if kind == DATA:
                    data += payload
                elif kind == HEADERS:
                    fields.update(payload)
                    if flags & END_STREAM:
                        return ("answer", fields, data)
            if not self._read_frame():
                return ("closed",)


class _Plain:
    """A random.Random whose draws frame a call plainly: no table size update, Huffman coding, padding, CONTINUATION,
    split DATA or trailers."""

    def random(self) -> float:
        return 1.0

    def choice(self, options):
        return options[0]


def normalized(answer):
    """What the two fronts must agree on: the status and message, and the answer's message with its outputs as
    arrays (compared with a tolerance: the fronts' batches differ)."""
    if answer[0] != "answer":
        return answer, None
    _, fields, data = answer
    status = (fields.get(":status"), fields.get("grpc-status"), fields.get("grpc-message") or None)
    if not data:
        return status, None
    try:
        message = service_pb2.ModelInferResponse.FromString(data[5:])
    except DecodeError:
        return status, data
    outputs = [np.frombuffer(raw, np.float32) for raw in message.raw_output_contents]
    del message.raw_output_contents[:]
    return (status, message.SerializeToString()), outputs


def same(python, native) -> bool:
    (python_status, python_outputs), (native_status, native_outputs) = normalized(python), normalized(native)
    if python_status != native_status:
        return False
    if isinstance(python_outputs, list) and isinstance(native_outputs, list):
        return len(python_outputs) == len(native_outputs) and all(
            a.shape == b.shape and np.allclose(a, b, rtol=1e-5, atol=1e-6)
            for a, b in zip(python_outputs, native_outputs, strict=True))
    return python_outputs == native_outputs


def infer_request(x: np.ndarray, **fields) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="digits", **fields)
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.astype(np.float32).tobytes())
    return request


def grpc_headers(**extra: str) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":path", INFER), (":authority", "localhost"),
            ("content-type", "application/grpc"), ("te", "trailers"), *extra.items()]


def body_of(message: bytes, compressed: bool = False) -> bytes:
    return bytes((int(compressed),)) + len(message).to_bytes(4, "big") + message


def served_by_front(server) -> int:
    return server.server.front.counters()["success"]


def test_a_modelinfer_call_is_answered_by_the_front_as_the_python_server_answers_it(fronts):
    x = inputs(3)
    requests = [infer_request(x), infer_request(x[:1], id="g-1", model_version="1"),
                infer_request(x[:2], id="asked for its output")]
    requests[2].outputs.add(name="output")
    before = served_by_front(fronts["native"])
    for request in requests:
        answers = {}
        for front, server in fronts.items():
            client = Client(server.grpc_port)
            try:
                answers[front] = client.call(grpc_headers(**{"grpc-timeout": "10S"}),
                                             body_of(request.SerializeToString()))
            finally:
                client.close()
        assert same(answers["python"], answers["native"]), answers
        _, fields, data = answers["native"]
        response = service_pb2.ModelInferResponse.FromString(data[5:])
        rows = request.inputs[0].shape[0]
        assert (fields["grpc-status"], response.model_name, response.model_version, response.id) == \
            ("0", "digits", "1", request.id)
        assert (response.outputs[0].name, response.outputs[0].datatype, list(response.outputs[0].shape)) == \
            ("output", "FP32", [rows, 10])
        np.testing.assert_allclose(np.frombuffer(response.raw_output_contents[0], np.float32).reshape(rows, 10),
                                   reference(x[:rows]), rtol=1e-5, atol=1e-6)
    assert served_by_front(fronts["native"]) == before + len(requests)


def _mangled_call(rng: random.Random) -> tuple[list[tuple[str, str]], bytes, str | None]:
    """A ModelInfer call, valid or not in one of the ways the front must leave to the Python server (or answer as it
    would), and what makes it a transport's own (None: nothing): a content-type not gRPC's ("content-type", which the
    front answers HTTP 415, where grpc-core ignores it), a grpc-timeout that is not one or a body cut short ("other":
    grpc-core ignores the first and waits out the call's deadline on the second, where the front leaves both to
    GrpcServer.start_call, which refuses them)."""
    rows = rng.choice([1, 2, 4])
    x = inputs(rows, seed=rng.randrange(1000))
    request = infer_request(x, id=rng.choice(["", "", "r-7", "r-8", "naïve", "tab\there"]),
                            model_version=rng.choice(["", "", "1", "1", "2"]))
    change = "none" if rng.random() < 0.5 else rng.choice([
        "model", "datatype", "shape", "rows", "raw-size", "typed", "output", "output-parameters", "parameters",
        "timeout-parameter", "two-inputs", "two-raws", "unknown", "truncated", "flipped", "no-input"])
    if change == "model":
        request.model_name = rng.choice(["", "other", "digits "])
    elif change == "datatype":
        request.inputs[0].datatype = rng.choice(["FP64", "INT32", "fp32", ""])
    elif change == "shape":
        request.inputs[0].shape[:] = rng.choice([[rows], [rows, 63], [rows, 64, 1], [1, rows * 64]])
    elif change == "rows":
        request.inputs[0].shape[0] = rng.choice([0, 33])
    elif change == "raw-size":
        request.raw_input_contents[0] = request.raw_input_contents[0][:-4]
    elif change == "typed":
        del request.raw_input_contents[:]
        request.inputs[0].contents.fp32_contents.extend(x.ravel().tolist())
    elif change == "output":
        request.outputs.add(name=rng.choice(["output", "other"]))
    elif change == "output-parameters":
        request.outputs.add(name="output").parameters["binary_data"].bool_param = True
    elif change == "parameters":
        request.parameters["priority"].int64_param = 1
    elif change == "timeout-parameter":
        request.parameters["timeout"].int64_param = 10_000_000
    elif change == "two-inputs":
        request.inputs.add(name="input", datatype="FP32", shape=[rows, 64])
    elif change == "two-raws":
        request.raw_input_contents.append(request.raw_input_contents[0])
    elif change == "no-input":
        del request.inputs[:]
    message = request.SerializeToString()
    if change == "unknown":
        message += b"\x40\x01"  # field 8 as a varint: unknown to this protocol
    elif change == "truncated":
        message = message[:rng.randrange(len(message))]
    elif change == "flipped":
        at = rng.randrange(len(message))
        message = message[:at] + bytes((message[at] ^ (1 << rng.randrange(8)),)) + message[at + 1:]
    headers = grpc_headers()
    compressed = False
    header_change = "none" if rng.random() < 0.5 else rng.choice([
        "timeout", "bad-timeout", "gzip", "identity", "content-type", "path", "metadata", "authorization"])
    if header_change == "timeout":
        headers.append(("grpc-timeout", rng.choice(["20S", "1M", "30000m", "99999999u"])))
    elif header_change == "bad-timeout":
        headers.append(("grpc-timeout", rng.choice(["10", "1.5S", "123456789S", "1x"])))
    elif header_change == "gzip":
        headers.append(("grpc-encoding", "deflate"))
        message, compressed = zlib.compress(message), True
    elif header_change == "identity":
        headers.append(("grpc-encoding", "identity"))
    elif header_change == "content-type":
        headers[4] = ("content-type", rng.choice(["application/grpc+proto", "text/plain", "application/json"]))
    elif header_change == "path":
        headers[2] = (":path", rng.choice([INFER + "X", "/inference.GRPCInferenceService/ModelReady", "/"]))
    elif header_change == "metadata":
        headers.append(("x-trace", "t" * rng.choice([1, 100, 3000])))
    elif header_change == "authorization":
        headers.append(("authorization", "Bearer not-asked-for"))
    body = body_of(message, compressed)
    transport = "content-type" if not headers[4][1].startswith("application/grpc") else \
        "other" if header_change == "bad-timeout" else None
    if rng.random() < 0.05:
        body = body[:rng.randrange(len(body))]
        transport = transport or "other"
    return headers, body, transport


def test_mangled_calls_get_the_python_servers_answer_and_never_stop_the_front(fronts):
    """Seeded random ModelInfer calls, each valid or mangled in one way (the message, its headers, how HPACK and the
    frames carry them to the C front), several per connection so that HPACK's dynamic table carries over: each is
    answered by the front as the Python server (grpc.aio, sent the call plainly framed) answers the same call, but
    for the calls whose answer is a transport's own (_mangled_call); the front took its share itself. FUZZ_CASES of them
    (TANDEM_FUZZ_CASES=5000 for a longer run by hand; TANDEM_FUZZ_SEED another seed)."""
    rng = random.Random(int(os.environ.get("TANDEM_FUZZ_SEED", "20")))
    before = served_by_front(fronts["native"])
    cases = int(os.environ.get("TANDEM_FUZZ_CASES", FUZZ_CASES))
    done = 0
    while done < cases:
        clients = {front: Client(server.grpc_port) for front, server in fronts.items()}
        seed = rng.randrange(1 << 30)
        try:
            for _ in range(rng.randint(1, 4)):
                headers, body, transport = _mangled_call(rng)
                native = clients["native"].call(headers, body, random.Random(seed))
                done += 1
                if transport == "content-type":
                    assert native == ("answer", {":status": "415"}, b""), (headers, native)
                elif transport is not None:
                    assert native[0] == "answer" and native[1]["grpc-status"] != "0", (headers, native)
                else:
                    python = clients["python"].call(headers, body)
                    assert same(python, native), (headers, body[:200], python, native)
        finally:
            for client in clients.values():
                client.close()
    assert served_by_front(fronts["native"]) - before > cases // 8


def test_a_full_queue_and_a_deadline_are_status_codes_from_the_front(fronts):
    """RESOURCE_EXHAUSTED past queueLimit and DEADLINE_EXCEEDED at the client's grpc-timeout, answered by the front
    for the calls it took (counted there), while the held forward keeps the rest waiting."""
    from inference_models import GATES
    from serving import gated_pool

    name = "native-grpc-limits"
    with Servers() as servers:
        server = servers(gated_pool(name, workersPerReplica=1, batchLimit=1, queueLimit=2, httpFront="native"),
                         grpc=True)
        gate = GATES[name]
        gate.close()
        x = inputs(1)
        request = infer_request(x)
        request.model_name = name
        body = body_of(request.SerializeToString())
        client = Client(server.grpc_port)
        try:
            stream_held = client.stream
            client.sock.sendall(frame(HEADERS, END_HEADERS, stream_held, client.encoder.encode(grpc_headers())) +
                                frame(DATA, END_STREAM, stream_held, body))
            client.stream += 2
            gate.wait_entered(1)
            expired = client.call(grpc_headers(**{"grpc-timeout": "50m"}), body)
            assert expired[0] == "answer" and expired[1]["grpc-status"] == "4", expired  # DEADLINE_EXCEEDED
            assert "deadline of 50 ms" in expired[1]["grpc-message"]
            queued = []
            for _ in range(2):
                stream = client.stream
                client.sock.sendall(frame(HEADERS, END_HEADERS, stream, client.encoder.encode(grpc_headers())) +
                                    frame(DATA, END_STREAM, stream, body))
                client.stream += 2
                queued.append(stream)
            refused = client.call(grpc_headers(), body)
            assert refused[0] == "answer" and refused[1]["grpc-status"] == "8", refused  # RESOURCE_EXHAUSTED
            assert "queue full" in refused[1]["grpc-message"]
            counters = server.server.front.counters()
            assert (counters["rejected"], counters["expired"]) == (1, 1)
            gate.open.set()
            for stream in (stream_held, *queued):
                answer = client._answer(stream)
                assert answer[0] == "answer" and answer[1]["grpc-status"] == "0", answer
        finally:
            client.close()


# -- limits and abuse: what libnghttp2 and the Limits given to the front make of a client that misbehaves ----------


@contextlib.contextmanager
def bare_front(**limits):
    """A front with no model (`Front(**limits)`, as a server has from its start): every gRPC call goes to calls().
    Yields it and connect(grpc=True), which opens a connection the front adopts (its client's socket)."""
    from tandem.worker.serve._front import Front

    front = Front(**Limits(**limits).for_front())
    thread = threading.Thread(target=front.run, daemon=True)
    thread.start()
    listener = socket.create_server(("127.0.0.1", 0))

    def connect(grpc: bool = True) -> socket.socket:
        client = socket.create_connection(listener.getsockname(), timeout=WAIT_S)
        accepted, _ = listener.accept()
        (front.adopt_grpc if grpc else front.adopt)(accepted.detach())
        return client

    try:
        yield front, connect
    finally:
        front.stop("the test is over")
        thread.join(WAIT_S)
        listener.close()


def next_call(front) -> tuple:
    """The next call the front hands to Python (calls())."""
    import time

    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        calls = front.calls()
        if calls:
            assert len(calls) == 1, calls
            return calls[0]
        time.sleep(0.01)
    raise AssertionError("no call reached calls()")


def test_a_message_over_the_limit_is_resource_exhausted_and_the_connection_serves_on():
    with bare_front(max_message_bytes=1000) as (front, connect):
        client = Client(sock=connect())
        try:
            refused = client.call(grpc_headers(), body_of(b"\x0a" * 5000))
            assert refused[0] == "answer" and refused[1]["grpc-status"] == "8", refused  # RESOURCE_EXHAUSTED
            assert "limit of 1000 bytes" in refused[1]["grpc-message"]
            assert front.calls() == []
            body = body_of(b"\x0a\x06digits")
            answered = client.stream
            client.sock.sendall(frame(HEADERS, END_HEADERS, answered, client.encoder.encode(grpc_headers())) +
                                frame(DATA, END_STREAM, answered, body))
            client.stream += 2
            serial, stream, headers, received = next_call(front)
            assert (stream, headers[":path"], received) == (answered, INFER, body)
            front.answer_call(serial, stream, 0, "", body_of(b"\x0a\x02ok"))
            answer = client._answer(answered)
            assert answer[0] == "answer" and answer[1]["grpc-status"] == "0" and answer[2] == body_of(b"\x0a\x02ok")
            front.answer_call(serial, stream, 0, "", None)  # a call answered already: dropped
        finally:
            client.close()


HELD_OPEN = {
    "nothing": (b"", ENHANCE_YOUR_CALM),
    "half a preface": (PREFACE[:10], ENHANCE_YOUR_CALM),
    "a stream held open": (hello() + frame(HEADERS, END_HEADERS, 1, header_block(grpc_headers())) +
                           frame(DATA, 0, 1, b"\0\0\0"), ENHANCE_YOUR_CALM),
    "a header block never ended": (hello() + frame(HEADERS, 0, 1, header_block(grpc_headers())),
                                   ENHANCE_YOUR_CALM),
    "no stream": (hello(), NO_ERROR),
}


@pytest.mark.parametrize("opening", HELD_OPEN)
def test_a_grpc_connection_that_holds_the_server_without_a_request_is_closed(opening):
    """Within the header timeout (the preface, a header block), the body timeout (a request's body) or the idle
    timeout (no stream open): GOAWAY, then closed; no call reached Python."""
    sent, code = HELD_OPEN[opening]
    with bare_front(header_timeout_s=0.3, body_timeout_s=0.5, idle_timeout_s=0.5) as (front, connect):
        sock = connect()
        try:
            sock.sendall(sent)
            received = read_until_closed(sock)  # the socket's timeout (WAIT_S) bounds the wait
        finally:
            sock.close()
        assert goaway_code(received) == code
        assert front.calls() == []


def test_an_http1_connection_holding_a_partial_request_is_closed():
    """Slowloris: the C front closes an HTTP/1.1 connection whose request does not arrive within the head's and the
    body's timeouts."""
    with bare_front(header_timeout_s=0.3, body_timeout_s=0.3, idle_timeout_s=60) as (front, connect):
        front.serve_model(model="m", version="1", input_name="input", example_shape=[4], output_name="output",
                          max_rows=8, queue_limit=4, timeout_ms=1000)
        sock = connect(grpc=False)
        try:
            sock.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: localhost\r\nContent-Length: 200\r\n\r\n{")
            assert read_until_closed(sock) == b""
        finally:
            sock.close()


@contextlib.contextmanager
def legitimate_client(port: int):
    """tritonclient.grpc calling ModelInfer in a loop on its own connection; yields the outcomes (True: answered
    right), which hold at least one once the block ends."""
    client = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
    x = inputs(1)
    outcomes, stop = [], threading.Event()

    def call() -> None:
        while not stop.is_set() or not outcomes:
            tensor = tgrpc.InferInput("input", [1, 64], "FP32")
            tensor.set_data_from_numpy(x)
            try:
                output = client.infer("digits", [tensor], client_timeout=WAIT_S).as_numpy("output")
                outcomes.append(np.allclose(output, reference(x), rtol=1e-5, atol=1e-6))
            except Exception as error:  # noqa: BLE001 (an outcome, asserted below)
                outcomes.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    try:
        yield outcomes
    finally:
        stop.set()
        thread.join()
        client.close()


FLOODS = {
    # HEADERS then RST_STREAM, stream after stream: past Limits' burst of resets (CVE-2023-44487)
    "rapid reset": lambda: hello() + b"".join(
        frame(HEADERS, END_HEADERS, stream, header_block(grpc_headers())) + rst_stream(stream)
        for stream in range(1, 2 * (Limits().reset_burst + 300), 2)),
    # a header block continued past Limits' CONTINUATION frames (CVE-2024-28182)
    "continuation": lambda: hello() + frame(HEADERS, 0, 1, header_block(grpc_headers())) +
    frame(CONTINUATION, 0, 1, b"") * 100,
}


@pytest.mark.parametrize("flood", FLOODS)
def test_a_flood_ends_its_connection_with_enhance_your_calm_while_a_client_beside_it_is_answered(fronts, flood):
    server = fronts["native"]
    with legitimate_client(server.grpc_port) as outcomes:
        sock = socket.create_connection(("127.0.0.1", server.grpc_port), timeout=WAIT_S)
        try:
            with contextlib.suppress(OSError):  # closed while the flood was still being sent
                sock.sendall(FLOODS[flood]())
            received = read_until_closed(sock)
        finally:
            sock.close()
    assert goaway_code(received) == ENHANCE_YOUR_CALM
    assert outcomes and all(outcome is True for outcome in outcomes), outcomes


@pytest.mark.parametrize("timeout", ["0n", "0S", "00m"])
@pytest.mark.parametrize("path", [INFER, "/inference.GRPCInferenceService/ServerLive"])
def test_a_grpc_timeout_of_zero_is_deadline_exceeded(fronts, path, timeout):
    client = Client(fronts["native"].grpc_port)
    try:
        headers = [(name, path if name == ":path" else value)
                   for name, value in grpc_headers(**{"grpc-timeout": timeout})]
        answer = client.call(headers, body_of(infer_request(inputs(1)).SerializeToString()))
    finally:
        client.close()
    assert answer[0] == "answer" and answer[1]["grpc-status"] == "4", answer  # DEADLINE_EXCEEDED


def test_an_uppercase_header_name_is_a_protocol_error_and_the_connection_serves_on(fronts):
    client = Client(fronts["native"].grpc_port)
    try:
        body = body_of(infer_request(inputs(1)).SerializeToString())
        refused = client.call(grpc_headers(**{"X-Trace": "1"}), body)
        assert refused in (("reset", PROTOCOL_ERROR), ("goaway", PROTOCOL_ERROR)), refused
        if refused[0] == "reset":
            answer = client.call(grpc_headers(), body)
            assert answer[0] == "answer" and answer[1]["grpc-status"] == "0", answer
    finally:
        client.close()
