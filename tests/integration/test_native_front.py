"""The C HTTP front (httpFront native, worker/serve/native.py and _front.c) over real sockets on 127.0.0.1: what it
answers itself must be what the Python server answers, and every request it does not take must reach the Python
server intact, on the same connection. tests/integration/test_server.py runs whole under both fronts too."""

from __future__ import annotations

import functools
import gzip
import json
import os
import random
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pytest
import tritonclient.http as triton
from inference_models import GATES, POISON
from serving import (
    WAIT_S,
    Servers,
    gated_pool,
    infer,
    inputs,
    json_body,
    log_until_listening,
    make_pool,
    needs_c_front,
    ports_in,
    reference,
    request,
    serve_process,
    wait_until,
)
from test_http import closed_by_server, connect, read_response

from tandem.api.inference import BatchingSettings
from tandem.worker.serve import app
from tandem.worker.serve.limits import Limits

pytestmark = needs_c_front

INFER = "/v2/models/digits/infer"
FUZZ_CASES = 150


def served_by_front(server) -> int:
    """Requests the C front answered 200 (the Python server's answers are not counted there)."""
    return server.server.front.counters()["success"]


def raw(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    sock = connect(port)
    try:
        sock.sendall(data)
        return read_response(sock, bytearray())
    finally:
        sock.close()


def test_a_json_request_is_answered_by_the_front_as_the_python_server_answers_it(fronts):
    x = inputs(3)
    bodies = [
        json_body(x),
        json_body(x[:1], id="r-1"),
        json_body(x[:1], id='quote " and \\u00e9'),
        # keys in another order, spaces and newlines anywhere, numbers in every JSON form
        b'{ "id" : "spaced",\n "inputs" : [ { "data" : [' + b" , ".join(b"%r" % float(v) for v in x[0]) +
        b' ] , "datatype" : "FP32" , "shape" : [ 1 , 64 ] , "name" : "input" } ] }',
        orjson.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                                  "data": [0, -0.0, 1e-3, -2E+2, 3.5e0, 1e-45, 17, *range(57)]}]}),
    ]
    before = served_by_front(fronts["native"])
    for body in bodies:
        answers = {front: request(server.port, "POST", INFER, body) for front, server in fronts.items()}
        (python_status, python_headers, python_body), (status, headers, native_body) = answers.values()
        assert (status, headers["Content-Type"]) == (python_status, python_headers["Content-Type"]) == (
            200, "application/json")
        expected, got = json.loads(python_body), json.loads(native_body)
        assert list(got) == list(expected) and got["outputs"][0].keys() == expected["outputs"][0].keys()
        data = np.asarray(got["outputs"][0].pop("data"), np.float32)
        np.testing.assert_array_equal(data, np.asarray(expected["outputs"][0].pop("data"), np.float32))
        assert got == expected
    assert served_by_front(fronts["native"]) == before + len(bodies)
    np.testing.assert_allclose(json.loads(request(fronts["native"].port, "POST", INFER, json_body(x))[2])
                               ["outputs"][0]["data"], reference(x).ravel(), rtol=1e-6, atol=1e-7)


def test_what_the_front_does_not_take_the_python_server_serves_on_the_same_connection(fronts):
    """A keep-alive connection: the front answers its first request, then hands the connection over with a request
    it does not take (a GET), and the Python server serves the rest, JSON inference included."""
    server = fronts["native"]
    x = inputs(2, seed=4)
    body = json_body(x)
    infer_request = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (INFER.encode(), len(body), body)
    before = served_by_front(server)
    sock, buffer = connect(server.port), bytearray()
    try:
        sock.sendall(infer_request)
        first = read_response(sock, buffer)
        # pipelined: an inference the front takes, then a GET it does not, then inference again
        sock.sendall(infer_request + b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n" + infer_request)
        second, ready, third = (read_response(sock, buffer) for _ in range(3))
    finally:
        sock.close()
    assert [first[0], second[0], ready[0], third[0]] == [200, 200, 200, 200]
    assert json.loads(ready[2]) == {"ready": True}
    for answer in (first, second, third):
        np.testing.assert_allclose(json.loads(answer[2])["outputs"][0]["data"], reference(x).ravel(), rtol=1e-6,
                                   atol=1e-7)
    assert served_by_front(server) == before + 2  # the third was the Python server's: the connection is its own now


def _request_bytes(case: str, body: bytes) -> bytes:
    """The inference request `body` sent as `case` says: each a form the front leaves to the Python server."""
    path, headers, version = INFER.encode(), b"Host: t\r\n", b"HTTP/1.1"
    if case == "gzip":
        body, headers = gzip.compress(body), headers + b"Content-Encoding: gzip\r\n"
    elif case == "chunked":
        return b"POST %s HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
            path, len(body), body)
    elif case == "connection close":
        headers += b"Connection: close\r\n"
    elif case == "http/1.0":
        version = b"HTTP/1.0"
    elif case == "version path":
        path = path.replace(b"/infer", b"/versions/1/infer")
    elif case == "escaped name":
        body = body.replace(b'"name":"input"', b'"name":"\\u0069nput"')
    return b"POST %s %s\r\n%sContent-Length: %d\r\n\r\n%s" % (path, version, headers, len(body), body)


@pytest.mark.parametrize("case", ["binary", "gzip", "chunked", "expect", "parameters", "outputs", "http/1.0",
                                  "nested data", "connection close", "version path", "escaped name", "unicode id"])
def test_requests_the_front_does_not_take_are_answered_as_the_python_server_answers_them(fronts, case):
    x = inputs(2, seed=5)
    if case == "binary":
        client = triton.InferenceServerClient(fronts["native"].url)
        np.testing.assert_allclose(infer(client, x, binary=True), reference(x), rtol=1e-6, atol=1e-7)
        return
    body = json_body(x)
    if case == "parameters":
        body = json_body(x, parameters={"timeout": 10_000_000})
    elif case == "outputs":
        body = json_body(x, outputs=[{"name": "output"}])
    elif case == "unicode id":
        body = json_body(x, id="caf\u00e9 \U0001f600")
    elif case == "nested data":
        body = orjson.dumps({"inputs": [{"name": "input", "shape": [2, 64], "datatype": "FP32", "data": x.tolist()}]})
    before = served_by_front(fronts["native"])
    answers = {}
    for front, server in fronts.items():
        if case == "expect":
            status, _, answer = _expect(server.port, body)
        else:
            status, _, answer = raw(server.port, _request_bytes(case, body))
        answers[front] = status, json.loads(answer)["outputs"][0]["data"]
    assert answers["native"][0] == answers["python"][0] == 200
    np.testing.assert_allclose(answers["native"][1], reference(x).ravel(), rtol=1e-6, atol=1e-7)
    assert served_by_front(fronts["native"]) == before


def _expect(port: int, body: bytes):
    sock, buffer = connect(port), bytearray()
    try:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
                     % (INFER.encode(), len(body)))
        assert read_response(sock, buffer)[0] == 100
        sock.sendall(body)
        return read_response(sock, buffer)
    finally:
        sock.close()


def _with_body(body: bytes, head: bytes = b"POST %s HTTP/1.1\r\nHost: t\r\n" % INFER.encode()) -> bytes:
    return head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


def _data(values: list[float]) -> bytes:
    return orjson.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                                     "data": [*values, *[0.5] * (64 - len(values))]}]})


@pytest.mark.parametrize(("sent", "status", "words"), [
    (b"POST %s\r\n\r\n" % INFER.encode(), 400, "an HTTP/0.9 request line (no HTTP version) is not served"),
    (b"GET /v2/health/ready\r\n\r\n", 400, "an HTTP/0.9 request line (no HTTP version) is not served"),
    (_with_body(json_body(inputs(1)), b"POST %s HTTP/1.1\r\n" % INFER.encode()), 400,
     "an HTTP/1.1 request needs one Host header (RFC 9112 3.2); it has 0"),
    (_with_body(json_body(inputs(1)), b"POST %s HTTP/1.1\r\nHost: a\r\nHost: b\r\n" % INFER.encode()), 400,
     "an HTTP/1.1 request needs one Host header (RFC 9112 3.2); it has 2"),
    (_with_body(json_body(inputs(1)), b"POST /v2/models/digits%2Finfer HTTP/1.1\r\nHost: t\r\n"), 400,
     "has an encoded slash (%2F) in a segment, which is refused rather than decoded"),
    (_with_body(json_body(inputs(1)), b"POST /v2/models%2fdigits/infer HTTP/1.1\r\nHost: t\r\n"), 400,
     "send the path with plain slashes"),
    (_with_body(_data([1e39])), 400, "input 'input': FP32 data out of range: 1e+39 is beyond the largest FP32 value"),
    (_with_body(_data([0.0, -1e39])), 400, "input 'input': FP32 data out of range: -1e+39"),
    (_with_body(_data([1e-50, -1e-60, 3.4028235e38])), 200, None),  # underflows to 0, the largest float32: fine
])
def test_what_the_rfcs_and_float32_refuse_is_refused_400_by_both_fronts(fronts, sent, status, words):
    """Strict where the RFCs are: the front hands such requests over and the Python server refuses them, naming the
    fix; a number float32 cannot hold is refused naming the input, one that underflows to 0 is served."""
    before = served_by_front(fronts["native"])
    for front, server in fronts.items():
        got, _, body = raw(server.port, sent)
        assert got == status, (front, body)
        if words is not None:
            assert words in json.loads(body)["error"], (front, body)
    assert served_by_front(fronts["native"]) == before + (status == 200)


@pytest.fixture(scope="module")
def impatient():
    """Both fronts with short head and body timeouts and a small budget of unread answers."""
    limits = functools.partial(Limits, header_timeout_s=0.3, body_timeout_s=0.3, unsent_bytes=64 << 10)
    with pytest.MonkeyPatch.context() as patch, Servers() as servers:
        patch.setattr(app, "Limits", limits)
        yield {front: servers(make_pool(httpFront=front, workersPerReplica=1)) for front in ("python", "native")}


@pytest.mark.parametrize("part", ["head", "body"])
@pytest.mark.parametrize("front", ["python", "native"])
def test_a_slowloris_client_is_closed_once_its_request_is_late(impatient, front, part):
    """A client sending an inference request a byte at a time, never finishing it (each byte keeps it from being
    idle): its connection is closed, after a 408 from the Python server (the C front closes it)."""
    sent = b"POST %s HTTP/1.1\r\nHost: t\r\n" % INFER.encode()
    if part == "body":
        sent += b"Content-Length: 5000\r\n\r\n{"
    sock, stop = connect(impatient[front].port), threading.Event()
    sock.sendall(sent)

    def trickle() -> None:
        while not stop.wait(0.05):
            try:
                sock.send(b" " if part == "body" else b"X")
            except OSError:
                return
    threading.Thread(target=trickle, daemon=True).start()
    try:
        try:
            status = read_response(sock, bytearray())[0]
        except ConnectionError:
            status = "closed"
        assert status == 408 if front == "python" else status in (408, "closed")
        assert closed_by_server(sock)
    finally:
        stop.set()
        sock.close()
    assert request(impatient[front].port, "POST", INFER, json_body(inputs(1)))[0] == 200


@pytest.mark.parametrize("front", ["python", "native"])
def test_a_client_that_pipelines_and_never_reads_does_not_stop_another_being_served(impatient, front):
    port = impatient[front].port
    greedy = socket.socket()
    greedy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its answers soon fill what the kernels hold
    greedy.settimeout(WAIT_S)
    greedy.connect(("127.0.0.1", port))
    body = json_body(inputs(1))
    flood = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (INFER.encode(), len(body), body)

    def send() -> None:
        try:
            for _ in range(100_000):
                greedy.sendall(flood * 10)
        except OSError:
            pass
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    x = inputs(2, seed=11)
    for _ in range(20):
        status, _, answer = request(port, "POST", INFER, json_body(x))
        assert status == 200
        np.testing.assert_allclose(json.loads(answer)["outputs"][0]["data"], reference(x).ravel(), rtol=1e-6,
                                   atol=1e-7)
    assert sender.is_alive()  # its requests are no longer read: it cannot send them all
    greedy.close()
    sender.join(WAIT_S)


def test_mangled_requests_get_the_python_servers_answer_and_never_stop_the_front(fronts):
    """Seeded mutations of a valid request (bytes dropped, added, changed, in its head or its body): each gets the
    status the Python server gives the same bytes, and the front still serves afterwards. FUZZ_CASES of them
    (TANDEM_FUZZ_CASES=5000 for a longer run by hand; TANDEM_FUZZ_SEED another seed)."""
    x = inputs(1, seed=6)
    valid = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (INFER.encode(), len(json_body(x)),
                                                                            json_body(x))
    before = served_by_front(fronts["native"])
    rng = random.Random(int(os.environ.get("TANDEM_FUZZ_SEED", "20")))
    alphabet = b'{}[]",:. -+eE0123456789\r\nabcdefghijklmnopqrstuvwxyzINPUTFP\\\x00\xff'
    differences = []
    for _ in range(int(os.environ.get("TANDEM_FUZZ_CASES", FUZZ_CASES))):
        head, body = bytearray(valid.partition(b"\r\n\r\n")[0] + b"\r\n\r\n"), bytearray(json_body(x))
        for _ in range(rng.randint(1, 4)):
            part = head if rng.random() < 0.3 else body
            at = rng.randrange(len(part))
            action = rng.randrange(3)
            if action == 0:
                del part[at]
            elif action == 1:
                part[at] = rng.choice(alphabet)
            else:
                part[at:at] = bytes([rng.choice(alphabet)])
        # the body's length follows its changes (a head changed may still say another)
        mangled = bytes(head).replace(b"Content-Length: %d" % len(json_body(x)), b"Content-Length: %d" % len(body)) \
            + bytes(body)
        statuses = {front: _status(server.port, mangled) for front, server in fronts.items()}
        if statuses["native"] != statuses["python"]:
            differences.append((mangled, statuses))
    assert not differences, differences[:3]
    assert served_by_front(fronts["native"]) - before >= 5  # mutations it still takes (a digit changed, say): 12
    assert request(fronts["native"].port, "POST", INFER, json_body(x))[0] == 200


def _status(port: int, data: bytes) -> int | str:
    """The status answered to `data` (a whole request, or bytes that are not one), or how the connection ended: bytes
    that wait for more get their answer once the client says it sends no more."""
    sock = connect(port)
    sock.settimeout(1.0)
    try:
        sock.sendall(data)
        try:
            return read_response(sock, bytearray())[0]
        except TimeoutError:
            sock.settimeout(WAIT_S)
            sock.shutdown(socket.SHUT_WR)
            return read_response(sock, bytearray())[0]
    except ConnectionError:
        return "closed"
    finally:
        sock.close()


def test_a_full_queue_is_429_from_the_front_and_every_request_it_took_is_answered():
    name = "front-queue"
    with Servers() as servers:
        server = servers(gated_pool(name, workersPerReplica=1, batchLimit=1, queueLimit=4, httpFront="native"))
        gate, inference = GATES[name], server.server.model.inference
        x = inputs(5)
        body = [json_body(x[i:i + 1]) for i in range(5)]
        gate.close()
        pool = ThreadPoolExecutor(5)
        accepted = [pool.submit(request, server.port, "POST", f"/v2/models/{name}/infer", body[0])]
        gate.wait_entered(1)
        accepted += [pool.submit(request, server.port, "POST", f"/v2/models/{name}/infer", body[i]) for i in
                     range(1, 5)]
        wait_until(lambda: inference.queued == 4, what="four queued requests")
        status, headers, answer = request(server.port, "POST", f"/v2/models/{name}/infer", body[0])
        assert (status, headers["Retry-After"]) == (429, "1")
        assert json.loads(answer)["error"] == "queue full: 4 requests already waiting (queue_limit=4); retry later"
        with pytest.raises(Exception) as binary:  # the Python server counts the front's queue too
            infer(triton.InferenceServerClient(server.url), x[:1], model=name)
        assert binary.value.status() == "429"
        gate.open.set()
        outputs = [json.loads(f.result(WAIT_S)[2])["outputs"][0]["data"] for f in accepted]
        pool.shutdown()
        np.testing.assert_allclose(np.asarray(outputs).reshape(5, 10), reference(x), rtol=1e-6, atol=1e-7)
        metrics = request(server.port, "GET", "/metrics")[2].decode()
        assert f'tandem_inference_requests_total{{model="{name}",outcome="rejected"}} 2.0' in metrics
        assert f'tandem_inference_requests_total{{model="{name}",outcome="success"}} 5.0' in metrics
        stats = triton.InferenceServerClient(server.url).get_inference_statistics(name)["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 5


def test_the_pools_timeout_is_504_from_the_front_for_queued_and_running_requests_and_a_client_may_leave():
    name = "front-timeout"
    with Servers() as servers:
        server = servers(gated_pool(name, workersPerReplica=1, batchLimit=1, requestTimeoutMs=300,
                                    httpFront="native"))
        gate, inference = GATES[name], server.server.model.inference
        body = json_body(inputs(1))
        path = f"/v2/models/{name}/infer"
        gate.close()
        pool = ThreadPoolExecutor(2)
        running = pool.submit(request, server.port, "POST", path, body)
        gate.wait_entered(1)
        queued = pool.submit(request, server.port, "POST", path, body)
        for answer in (running.result(WAIT_S), queued.result(WAIT_S)):
            assert answer[0] == 504
            assert json.loads(answer[2])["error"] == "no output within the pool's requestTimeoutMs of 300 ms"
        leaving = connect(server.port)
        head = b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(body))
        leaving.sendall(head + body)
        wait_until(lambda: inference.queued == 1, what="a queued request")
        leaving.close()
        wait_until(lambda: inference.queued == 0, what="the request withdrawn")
        gate.open.set()
        pool.shutdown()
        wait_until(lambda: server.server.pending_count == 0, what="nothing pending")
        assert request(server.port, "POST", path, body)[0] == 200
        stats = triton.InferenceServerClient(server.url).get_inference_statistics(name)["model_stats"][0]
        assert stats["inference_stats"]["fail"]["count"] >= 2  # the queued one timed out and the one withdrawn


def test_behind_a_token_the_front_answers_the_pools_token_and_the_python_server_refuses_the_rest(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with Servers() as servers:
        server = servers(make_pool(httpFront="native", auth={"secretName": "token"}), auth_token_file=str(token))
        x = inputs(1)
        good = request(server.port, "POST", INFER, json_body(x), {"Authorization": "Bearer s3cret"})
        assert good[0] == 200 and served_by_front(server) == 1
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            status, answer_headers, _ = request(server.port, "POST", INFER, json_body(x), headers)
            assert (status, answer_headers.get("WWW-Authenticate")) == (401, 'Bearer realm="tandem"')
        token.write_text("rotated\n")  # the front learns it within a second; until then the Python server answers
        assert request(server.port, "POST", INFER, json_body(x), {"Authorization": "Bearer rotated"})[0] == 200
        assert request(server.port, "POST", INFER, json_body(x), {"Authorization": "Bearer s3cret"})[0] == 401
        wait_until(lambda: request(server.port, "POST", INFER, json_body(x), {"Authorization": "Bearer rotated"})[0]
                   == 200 and served_by_front(server) >= 2, what="the front serving the rotated token")
        assert request(server.port, "GET", "/v2/health/ready")[0] == 200


def test_a_batching_change_reaches_the_front_and_concurrent_clients_each_get_their_own_rows():
    with Servers() as servers:
        server = servers(make_pool(httpFront="native", workersPerReplica=1, batchLimit=4))
        x = inputs(8, seed=9)
        assert request(server.port, "POST", INFER, json_body(x))[0] == 400  # 8 rows: over batchLimit 4
        server.update_batching(BatchingSettings(batchLimit=8))  # as a server following its pool does
        assert request(server.port, "POST", INFER, json_body(x))[0] == 200
        before = served_by_front(server)

        def one(i: int) -> np.ndarray:
            rows = x[i % 8:i % 8 + 1 + i % 3]
            answer = json.loads(request(server.port, "POST", INFER, json_body(rows))[2])
            return np.asarray(answer["outputs"][0]["data"], np.float32).reshape(len(rows), 10), rows

        with ThreadPoolExecutor(8) as pool:
            for got, rows in pool.map(one, range(64)):
                np.testing.assert_allclose(got, reference(rows), rtol=1e-6, atol=1e-7)
        assert served_by_front(server) == before + 64
        batches = triton.InferenceServerClient(server.url).get_inference_statistics("digits")["model_stats"][0]
        assert max(entry["batch_size"] for entry in batches["batch_stats"]) <= 8


def test_a_drain_answers_what_the_front_took_and_refuses_new_requests_503():
    name = "front-drain"
    with Servers() as servers:
        background = servers(gated_pool(name, workersPerReplica=1, batchLimit=1, httpFront="native"))
        gate = GATES[name]
        path = f"/v2/models/{name}/infer"
        x = inputs(1)
        gate.close()
        pool = ThreadPoolExecutor(2)
        held = pool.submit(request, background.port, "POST", path, json_body(x))
        gate.wait_entered(1)
        kept_open = connect(background.port)  # a connection the front holds, idle
        draining = threading.Thread(target=background.drain, daemon=True)
        draining.start()
        wait_until(lambda: background.server.draining, what="draining")
        body = json_body(x)
        kept_open.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s"
                          % (path.encode(), len(body), body))
        status, headers, answer = read_response(kept_open, bytearray())
        assert (status, headers["retry-after"], json.loads(answer)["error"]) == (
            503, "1", "the server is shutting down")
        gate.open.set()
        assert held.result(WAIT_S)[0] == 200
        draining.join(WAIT_S)
        assert closed_by_server(kept_open)
        pool.shutdown()


def test_tandem_serve_http_front_native_overrides_the_pool_and_a_model_it_cannot_serve_keeps_the_python_server(
        tmp_path):
    manifest = tmp_path / "pool.json"
    manifest.write_text(json.dumps(make_pool(workersPerReplica=1).to_dict()))
    process = serve_process(manifest, "--http-front", "native", "--no-grpc")
    try:
        log = log_until_listening(process)
        port = ports_in(log[-1])[0]
        wait_until(lambda: request(port, "GET", "/v2/health/ready")[0] == 200, what="ready")
        x = inputs(2)
        answer = json.loads(request(port, "POST", INFER, json_body(x))[2])
        np.testing.assert_allclose(answer["outputs"][0]["data"], reference(x).ravel(), rtol=1e-6, atol=1e-7)
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert "httpFront native: the C front serves JSON inference requests" in "".join(log) + process.stderr.read()
    with Servers() as servers:  # inplace mode has no queue for the front to fill: the Python server serves it all
        server = servers(make_pool(inferenceMode="inplace", httpFront="native"))
        assert server.server.front is None
        assert request(server.port, "POST", INFER, json_body(x))[0] == 200


def test_a_forward_that_fails_fails_only_the_request_that_broke_it_among_the_fronts_requests():
    name = "front-poison"
    with Servers() as servers:
        server = servers(gated_pool(name, workersPerReplica=1, httpFront="native"))
        gate, inference = GATES[name], server.server.model.inference
        x = inputs(4)
        x[2, 5] = POISON
        path = f"/v2/models/{name}/infer"
        pool = ThreadPoolExecutor(4)
        gate.close()
        answers = [pool.submit(request, server.port, "POST", path, json_body(x[:1]))]
        gate.wait_entered(1)
        answers += [pool.submit(request, server.port, "POST", path, json_body(x[i:i + 1])) for i in (1, 2, 3)]
        wait_until(lambda: inference.queued == 3, what="three queued requests")
        gate.open.set()
        statuses = [answer.result(WAIT_S)[0] for answer in answers]
        pool.shutdown()
        assert statuses == [200, 200, 500, 200]
        assert "poisoned input" in json.loads(answers[2].result()[2])["error"]
        for i in (0, 1, 3):
            np.testing.assert_allclose(json.loads(answers[i].result()[2])["outputs"][0]["data"],
                                       reference(x[i:i + 1]).ravel(), rtol=1e-6, atol=1e-7)
        assert 3 in gate.batches  # the three queued requests ran as one batch (one bundle) before the retry
        assert server.server.front.counters()["success"] == 3
