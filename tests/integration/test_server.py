"""The inference server over real HTTP on 127.0.0.1 (ephemeral ports): tritonclient.http as the client, plain
http.client where a test needs the raw response (headers, exact bytes). Requests are held at a known point
with a gate (inference_models.Gate), never with sleeps or timed assertions."""

from __future__ import annotations

import json
import logging
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pytest
import torch
import tritonclient.http as triton
from inference_models import GATES, POISON, Forward, Gate
from serving import (
    WAIT_S,
    Servers,
    fill_the_queue,
    gated_pool,
    infer,
    infer_in_thread,
    inputs,
    json_body,
    make_pool,
    port_from_log,
    reference,
    request,
    serve_process,
    wait_until,
    write_checkpoint,
)
from tritonclient.utils import InferenceServerException

from tandem.api.inference import BatchingSettings
from tandem.cli import main as cli_main
from tandem.worker.serve.app import InferenceServer
from tandem.worker.serve.model_loading import ModelLoadError
from tandem.worker.serve.served_model import BatchingRefused

pytestmark = pytest.mark.usefixtures("http_front")  # every test here, under both fronts (conftest.py)


def test_tritonclient_health_metadata_config_and_infer_with_json_and_binary_tensors(served):
    server = served(make_pool(workersPerReplica=2, maxQueueDelayMicroseconds=100))
    client = triton.InferenceServerClient(server.url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits") and client.is_model_ready("digits", "1")
    metadata = client.get_server_metadata()
    assert metadata["name"] == "tandem" and "binary_tensor_data" in metadata["extensions"]
    model = client.get_model_metadata("digits", "1")
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    assert model["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}]
    config = client.get_model_config("digits")
    assert config["max_batch_size"] == 32
    assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [64]}]
    assert config["output"][0]["dims"] == [10]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert config["instance_group"][0]["count"] == 2
    x = inputs(3)
    for binary in (True, False):
        np.testing.assert_allclose(infer(client, x, binary=binary), reference(x), rtol=1e-5, atol=1e-6)
    # No requested outputs: tritonclient asks for binary_data_output
    tensor = triton.InferInput("input", [3, 64], "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("digits", [tensor], request_id="r-1")
    assert result.get_response()["id"] == "r-1"
    assert result.get_response()["outputs"][0]["parameters"] == {"binary_data_size": 3 * 10 * 4}
    np.testing.assert_allclose(result.as_numpy("output"), reference(x), rtol=1e-5, atol=1e-6)
    compressed = client.infer("digits", [tensor], request_compression_algorithm="gzip")
    np.testing.assert_allclose(compressed.as_numpy("output"), reference(x), rtol=1e-5, atol=1e-6)
    stats = client.get_inference_statistics("digits")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == 4
    assert stats["inference_count"] == 12
    assert client.get_model_repository_index() == [
        {"name": "digits", "version": "1", "state": "READY", "reason": "callable"}]


def test_json_request_without_content_type_and_binary_response_on_request(served):
    server = served(make_pool())
    x = inputs(2)
    status, headers, body = request(server.port, "POST", "/v2/models/digits/infer", json_body(x))
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    answer = json.loads(body)
    np.testing.assert_allclose(np.array(answer["outputs"][0]["data"]).reshape(2, 10), reference(x), rtol=1e-5,
                               atol=1e-6)
    # Binary input, binary output, by hand: JSON header, then the raw tensor bytes
    header = orjson.dumps({"inputs": [{"name": "input", "shape": [2, 64], "datatype": "FP32",
                                       "parameters": {"binary_data_size": x.nbytes}}],
                           "parameters": {"binary_data_output": True}})
    status, headers, body = request(server.port, "POST", "/v2/models/digits/versions/1/infer", header + x.tobytes(),
                                    {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200
    length = int(headers["Inference-Header-Content-Length"])
    head = json.loads(body[:length])
    assert head["outputs"][0]["parameters"]["binary_data_size"] == len(body) - length == 80
    np.testing.assert_allclose(np.frombuffer(body[length:], dtype=np.float32).reshape(2, 10), reference(x),
                               rtol=1e-5, atol=1e-6)


def test_many_concurrent_clients_each_get_exactly_their_own_outputs(served):
    server = served(make_pool(workersPerReplica=2, queueLimit=256))
    x = inputs(240, seed=5)
    expected = reference(x)
    client = triton.InferenceServerClient(server.url, concurrency=48)
    handles = []
    for i in range(len(x)):  # each request: 1 or 2 examples, binary or JSON
        rows = x[i:i + 1] if i % 3 else x[i:i + 2]
        tensor = triton.InferInput("input", list(rows.shape), "FP32")
        tensor.set_data_from_numpy(rows, binary_data=bool(i % 2))
        output = triton.InferRequestedOutput("output", binary_data=bool(i % 2))
        handles.append((i, len(rows), client.async_infer("digits", [tensor], outputs=[output])))
    for i, rows, handle in handles:
        np.testing.assert_allclose(handle.get_result(timeout=WAIT_S).as_numpy("output"), expected[i:i + rows],
                                   rtol=1e-5, atol=1e-6)
    stats = client.get_inference_statistics("digits")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == len(x)
    client.close()


def test_json_and_binary_requests_queued_together_share_one_forward_and_each_gets_its_own_rows(served):
    """Through HTTP a model has one input shape and dtype (others are refused with 400 before they are queued),
    so every request queued behind a running forward belongs in the next one: JSON and binary requests of 1 to 3
    examples alike. Every value of a request's input is its id; the Recorder answers each row with it."""
    name = "composition"
    GATES.pop(name, None)
    server = served(make_pool(name, model={"callable": "inference_models:recorder", "args": {"name": name},
                                           "inputShape": [4]}, workersPerReplica=1))
    gate = GATES[name]
    inference = server.server.model.inference
    sizes = {1: 1, 2: 1, 3: 2, 4: 1, 5: 3, 6: 1}  # request id: examples
    pool = ThreadPoolExecutor(len(sizes))
    gate.close()
    futures = {}
    for request_id, rows in sizes.items():
        x = np.full((rows, 4), request_id, np.float32)
        futures[request_id] = pool.submit(infer_in_thread, server.url, x, name, bool(request_id % 2))
        if request_id == 1:
            gate.wait_entered(1)
        else:
            wait_until(lambda count=request_id - 1: inference.queued == count, what=f"{request_id - 1} queued")
    gate.open.set()
    for request_id, rows in sizes.items():
        np.testing.assert_array_equal(futures[request_id].result(WAIT_S), np.full((rows, 1), request_id, np.float32))
    pool.shutdown()
    assert gate.forwards == [Forward((1,), (4,), torch.float32),
                             Forward((2, 3, 3, 4, 5, 5, 5, 6), (4,), torch.float32)]


def test_the_three_modes_serve_identical_outputs(served):
    x = inputs(20, seed=9)
    results = {}
    for mode in ("batched", "sequential", "inplace"):
        server = served(make_pool(f"m-{mode}", inferenceMode=mode, workersPerReplica=2))
        client = triton.InferenceServerClient(server.url, concurrency=8)
        handles = []
        for i in range(len(x)):
            tensor = triton.InferInput("input", [1, 64], "FP32")
            tensor.set_data_from_numpy(x[i:i + 1])
            handles.append(client.async_infer(f"m-{mode}", [tensor]))
        results[mode] = np.concatenate([h.get_result(timeout=WAIT_S).as_numpy("output") for h in handles])
        client.close()
    np.testing.assert_allclose(results["batched"], results["sequential"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results["sequential"], results["inplace"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results["batched"], reference(x), rtol=1e-5, atol=1e-6)


def test_a_full_queue_answers_429_with_retry_after_and_every_accepted_request_succeeds(served):
    name = "queue-full"
    server = served(gated_pool(name, workersPerReplica=1, batchLimit=1, queueLimit=4))
    gate = GATES[name]
    x = inputs(5)
    pool, accepted = fill_the_queue(name, server.server.model.inference,
                                    lambda i: infer_in_thread(server.url, x[i:i + 1], name))
    for _ in range(3):
        status, headers, body = request(server.port, "POST", f"/v2/models/{name}/infer", json_body(x[:1]))
        assert status == 429 and headers["Retry-After"] == "1"
        assert "queue full: 4 requests already waiting" in json.loads(body)["error"]
    with pytest.raises(InferenceServerException) as rejected:
        infer(triton.InferenceServerClient(server.url), x[:1], model=name)
    assert rejected.value.status() == "429"
    gate.open.set()
    outputs = np.concatenate([f.result(WAIT_S) for f in accepted])
    pool.shutdown()
    np.testing.assert_allclose(outputs, reference(x), rtol=1e-5, atol=1e-6)
    metrics = request(server.port, "GET", "/metrics")[2].decode()
    assert f'tandem_inference_requests_total{{model="{name}",outcome="rejected"}} 4.0' in metrics
    assert f'tandem_inference_requests_total{{model="{name}",outcome="success"}} 5.0' in metrics


def test_hot_swap_under_concurrent_load_fails_nothing_and_later_outputs_come_from_the_new_model(served, tmp_path):
    first = write_checkpoint(tmp_path / "a", seed=1, step=1)
    second = write_checkpoint(tmp_path / "b", seed=2, step=2)
    server = served(make_pool(model={"checkpoint": str(first)}, workersPerReplica=2, queueLimit=128,
                              modelRepository={"load": True, "root": str(tmp_path)}))
    x = inputs(8, seed=3)
    old, new = reference(x, seed=1), reference(x, seed=2)
    stop = threading.Event()
    swapped = threading.Event()
    failures, counts = [], {"old": 0, "new": 0}

    def client_loop(index: int) -> None:
        client = triton.InferenceServerClient(server.url)
        row = x[index:index + 1]
        try:
            for _ in range(100_000):
                if stop.is_set():
                    return
                was_swapped = swapped.is_set()
                try:
                    y = infer(client, row, binary=bool(index % 2))
                except Exception as error:  # collected: the test asserts there are none
                    failures.append(repr(error))
                    return
                if np.allclose(y, new[index:index + 1], rtol=1e-5, atol=1e-6):
                    counts["new"] += 1
                elif np.allclose(y, old[index:index + 1], rtol=1e-5, atol=1e-6) and not was_swapped:
                    counts["old"] += 1
                else:
                    failures.append(f"client {index}: output from neither the served nor the new model")
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(len(x))]
    for thread in threads:
        thread.start()
    inference = server.server.model.inference
    wait_until(lambda: inference.stats.snapshot()["success_count"] >= 30, what="load before the swap")
    admin = triton.InferenceServerClient(server.url)
    admin.load_model("digits", config=json.dumps({"checkpoint": str(second)}))  # tritonclient's own call
    swapped.set()
    done = inference.stats.snapshot()["success_count"]
    wait_until(lambda: inference.stats.snapshot()["success_count"] >= done + 30, what="load after the swap")
    stop.set()
    for thread in threads:
        thread.join(WAIT_S)
    assert failures == []
    # 30 answers came before the swap, and of the 30 after it at most one per client (8) was sent before it;
    # measured (5 runs, 2 cores): old 79..144, new 38..57
    assert counts["old"] >= 30 and counts["new"] >= 22, counts
    np.testing.assert_allclose(infer(admin, x), new, rtol=1e-5, atol=1e-6)
    assert admin.get_model_repository_index()[0]["reason"] == str(second)


def binary_case(size: int, payload: int, status: int, words: str, header_length: int | None = None):
    header = ('{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", '
              f'"parameters": {{"binary_data_size": {size}}}}}]}}')
    length = len(header) if header_length is None else header_length
    return ("POST", "/v2/models/digits/infer", header + "x" * payload, {"Inference-Header-Content-Length": str(length)},
            status, words)


BAD_REQUESTS = [
    # (method, path, body, headers, status, words in the error)
    ("POST", "/v2/models/nope/infer", "{}", {}, 404, "unknown model 'nope'"),
    ("POST", "/v2/models/digits/versions/7/infer", "{}", {}, 404, "no version '7'"),
    ("GET", "/v2/models/nope", None, {}, 404, "unknown model 'nope'"),
    ("GET", "/v2/models/nope/config", None, {}, 404, "unknown model"),
    ("GET", "/v2/nothing/here", None, {}, 404, "no endpoint GET /v2/nothing/here"),
    ("GET", "/v2/models/digits/infer", None, {}, 405, "GET is not allowed"),
    ("POST", "/v2/models/digits/infer", "", {}, 400, "empty request body"),
    ("POST", "/v2/models/digits/infer", "{not json", {}, 400, "malformed JSON"),
    ("POST", "/v2/models/digits/infer", "[1, 2]", {}, 400, "must be a JSON object"),
    ("POST", "/v2/models/digits/infer", '{"inputs": []}', {}, 400, "non-empty 'inputs' list"),
    ("POST", "/v2/models/digits/infer", '{"inputs": [7]}', {}, 400, "inputs[0] must be an object"),
    ("POST", "/v2/models/digits/infer",
     '{"inputs": [{"name": "pixels", "shape": [1, 64], "datatype": "FP32", "data": []}]}', {}, 400,
     "unknown input 'pixels': the model's only input is 'input'"),
    ("POST", "/v2/models/digits/infer",
     '{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "INT64", "data": []}]}', {}, 400,
     "datatype 'INT64' does not match the model's FP32"),
    ("POST", "/v2/models/digits/infer",
     '{"inputs": [{"name": "input", "shape": [1, 63], "datatype": "FP32", "data": []}]}', {}, 400,
     "shape [1, 63] does not match the model's [-1, 64]"),
    ("POST", "/v2/models/digits/infer",
     '{"inputs": [{"name": "input", "shape": ["1", 64], "datatype": "FP32", "data": []}]}', {}, 400,
     "shape must be a list of non-negative integers"),
    ("POST", "/v2/models/digits/infer",
     '{"inputs": [{"name": "input", "shape": [33, 64], "datatype": "FP32", "data": []}]}', {}, 400,
     "batch size 33 is outside 1..32"),
    ("POST", "/v2/models/digits/infer",
     '{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [1, 2, 3]}]}', {}, 400,
     "data holds 3 values; shape [1, 64] needs 64"),
    ("POST", "/v2/models/digits/infer",
     '{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": ' + json.dumps(["x"] * 64) + "}]}",
     {}, 400, "FP32 data must be numbers; found strings"),
    ("POST", "/v2/models/digits/infer",
     '{"inputs": [{"name": "input", "shape": [2, 64], "datatype": "FP32", "data": [[1, 2], [3]]}]}', {}, 400,
     "not a regular nested list"),
    ("POST", "/v2/models/digits/infer",
     '{"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32"}]}', {}, 400, "no data"),
    binary_case(100, 100, 400, "binary_data_size 100 does not fit shape [1, 64] of FP32 (256 bytes)"),
    binary_case(256, 10, 400, "does not match the 10 bytes after the JSON header"),
    binary_case(256, 256, 400, "is outside the body's", header_length=10_000),
    ("POST", "/v2/models/digits/infer", "{}", {"Inference-Header-Content-Length": "abc"}, 400,
     "Inference-Header-Content-Length: 'abc' is not a byte count"),
    ("POST", "/v2/models/digits/infer", json_body(np.zeros((1, 64), np.float32), outputs=[{"name": "probs"}]).decode(),
     {}, 400, "unknown output 'probs': the model's only output is 'output'"),
    ("POST", "/v2/models/digits/infer", json_body(np.zeros((1, 64), np.float32),
                                                  parameters={"timeout": "soon"}).decode(),
     {}, 400, "parameters.timeout must be a non-negative integer"),
    ("POST", "/v2/models/digits/infer", json_body(np.zeros((1, 64), np.float32), id=5).decode(), {}, 400,
     "id must be a string"),
    ("POST", "/v2/models/digits/infer", "[" + "0," * 600_000 + "0]", {}, 413, "request body too large"),
    # loads are off by default (tests/integration/test_model_repository.py has them on)
    ("POST", "/v2/repository/models/digits/load", '{"parameters": {"checkpoint": "/etc/passwd"}}', {}, 403,
     "model repository loads are disabled: set spec.modelRepository.load: true in the InferencePool"),
    ("POST", "/v2/repository/models/digits/unload", "", {}, 400, "unloading is not supported"),
]


@pytest.fixture(scope="module")
def one_server(http_front):
    """One server for every bad request (each is a case of its own; none changes what the server serves)."""
    with Servers() as servers:
        yield servers(make_pool())


def send(server, method: str, path: str, body: str | None, headers: dict) -> tuple[int, dict, bytes]:
    return request(server.port, method, path, None if body is None else body.encode(), headers)


@pytest.mark.parametrize(("method", "path", "body", "headers", "status", "words"), BAD_REQUESTS,
                         ids=[f"{case[4]}-{case[5][:48]}" for case in BAD_REQUESTS])
def test_a_bad_request_gets_its_4xx_naming_the_problem(one_server, method, path, body, headers, status, words):
    got, response_headers, raw = send(one_server, method, path, body, headers)
    assert response_headers["Content-Type"].startswith("application/json"), (path, body)
    error = json.loads(raw)["error"]
    assert (got, words in error) == (status, True), (method, path, body[:80] if body else None, got, error)


def test_bad_requests_leave_the_server_serving_and_are_counted_as_invalid(served):
    """All the bad requests above on one fresh server: it still answers, and its counter of invalid requests counts
    exactly the inference requests among them (each row's own answer is checked by the test above)."""
    server = served(make_pool())
    for method, path, body, headers, _, _ in BAD_REQUESTS:
        send(server, method, path, body, headers)
    x = inputs(2)
    np.testing.assert_allclose(infer(triton.InferenceServerClient(server.url), x), reference(x), rtol=1e-5, atol=1e-6)
    metrics = request(server.port, "GET", "/metrics")[2].decode()
    # bodies over the limit are refused by the HTTP layer before they reach the model's counters
    invalid = sum(1 for method, path, _, _, status, _ in BAD_REQUESTS
                  if method == "POST" and path.endswith("/infer") and status != 413)
    assert f'tandem_inference_requests_total{{model="digits",outcome="invalid"}} {float(invalid)}' in metrics


def test_an_exception_in_a_forward_fails_only_that_request(served):
    name = "poison"
    server = served(gated_pool(name, workersPerReplica=1))
    gate = GATES[name]
    inference = server.server.model.inference
    x = inputs(4)
    x[2, 5] = POISON
    pool = ThreadPoolExecutor(4)
    gate.close()
    futures = []
    for i in range(4):
        futures.append(pool.submit(infer_in_thread, server.url, x[i:i + 1], name))
        if i == 0:
            gate.wait_entered(1)
    wait_until(lambda: inference.queued == 3, what="three queued requests")
    gate.open.set()
    with pytest.raises(InferenceServerException) as failed:
        futures[2].result(WAIT_S)
    assert failed.value.status() == "500" and "poisoned input" in failed.value.message()
    for i in (0, 1, 3):
        np.testing.assert_allclose(futures[i].result(WAIT_S), reference(x[i:i + 1]), rtol=1e-5, atol=1e-6)
    pool.shutdown()
    assert 3 in gate.batches  # the three queued requests ran as one batch before the retry one by one
    np.testing.assert_allclose(infer_in_thread(server.url, x[:2], name), reference(x[:2]), rtol=1e-5, atol=1e-6)

def test_a_request_timeout_answers_504_and_the_request_leaves_the_queue(served):
    name = "timeout"
    server = served(gated_pool(name, workersPerReplica=1))
    gate = GATES[name]
    pool = ThreadPoolExecutor(1)
    gate.close()
    running = pool.submit(infer_in_thread, server.url, inputs(1), name)
    gate.wait_entered(1)
    with pytest.raises(InferenceServerException) as timed_out:
        infer(triton.InferenceServerClient(server.url), inputs(1), model=name, timeout=20_000)  # microseconds
    assert timed_out.value.status() == "504" and "timeout of 20 ms" in timed_out.value.message()
    assert server.server.model.inference.queued == 0
    gate.open.set()
    running.result(WAIT_S)
    pool.shutdown()


def test_the_pools_request_timeout_alone_answers_504_to_running_and_queued_requests(served):
    """requestTimeoutMs with no parameters.timeout: a request held in a forward (which ParallelInference cannot
    interrupt) and one queued behind it both get 504 from the server's timeout sweep while the forward is still
    held, and leave the queue."""
    name = "pool-timeout"
    server = served(gated_pool(name, workersPerReplica=1, batchLimit=1, requestTimeoutMs=200))
    gate = GATES[name]
    inference = server.server.model.inference
    pool = ThreadPoolExecutor(2)

    def timed(x: np.ndarray) -> tuple[int, str, float]:
        start = time.monotonic()
        # bounded: a server that never sweeps on requestTimeoutMs fails here instead of waiting for the gate
        status, _, body = request(server.port, "POST", f"/v2/models/{name}/infer", json_body(x), timeout=10)
        return status, json.loads(body)["error"], time.monotonic() - start

    gate.close()
    running = pool.submit(timed, inputs(1))
    gate.wait_entered(1)
    queued = pool.submit(timed, inputs(1, seed=2))
    for future in (running, queued):
        status, error, elapsed = future.result(WAIT_S)
        assert (status, error) == (504, "no output within the pool's requestTimeoutMs of 200 ms")
        assert elapsed >= 0.2
    assert not gate.open.is_set() and gate.entered == 1  # answered while the first forward is still held
    assert inference.queued == 0 and server.server.pending.count == 0
    gate.open.set()
    pool.shutdown()
    metrics = request(server.port, "GET", "/metrics")[2].decode()
    assert f'tandem_inference_requests_total{{model="{name}",outcome="failed"}} 2.0' in metrics
    x = inputs(1, seed=3)  # still serving
    np.testing.assert_allclose(infer_in_thread(server.url, x, name), reference(x), rtol=1e-5, atol=1e-6)


def test_not_ready_until_the_model_is_loaded_but_live_at_once(served):
    name = "slow-build"
    GATES.pop(name, None)
    gate = GATES.setdefault(name, Gate())
    gate.open.clear()
    pool = make_pool(name, model={"callable": "inference_models:slow_to_build", "args": {"name": name},
                                  "inputShape": [64]})
    server = InferenceServer(pool)
    served_holder: list = []
    started = threading.Thread(target=lambda: served_holder.append(server.start_in_thread()))
    started.start()
    wait_until(lambda: server.port is not None, what="listening")
    assert request(server.port, "GET", "/v2/health/live")[:1] == (200,)
    status, _, body = request(server.port, "GET", "/v2/health/ready")
    assert (status, json.loads(body)) == (503, {"ready": False})
    status, _, body = request(server.port, "POST", f"/v2/models/{name}/infer", json_body(inputs(1)))
    assert status == 503 and "not loaded yet" in json.loads(body)["error"]
    gate.open.set()
    started.join(WAIT_S)
    background = served_holder[0]
    try:
        assert request(server.port, "GET", "/v2/health/ready")[0] == 200
        assert request(server.port, "GET", f"/v2/models/{name}/ready")[0] == 200
    finally:
        background.stop()


def test_two_servers_in_one_process_keep_their_own_metrics(served):
    first, second = served(make_pool("one")), served(make_pool("two", batchLimit=8))
    infer(triton.InferenceServerClient(first.url), inputs(3), model="one")
    one = request(first.port, "GET", "/metrics")[2].decode()
    two = request(second.port, "GET", "/metrics")[2].decode()
    assert 'tandem_inference_requests_total{model="one",outcome="success"} 1.0' in one
    assert 'tandem_inference_examples_total{model="one"} 3.0' in one
    assert 'tandem_inference_batch_size_bucket{le="4.0",model="one"} 1.0' in one
    assert 'tandem_inference_requests_total{model="two",outcome="success"} 0.0' in two
    assert 'tandem_inference_batch_size_bucket{le="8.0",model="two"} 0.0' in two
    for family in ("tandem_inference_pending_requests", "tandem_inference_queue_duration_seconds_bucket",
                   "tandem_inference_compute_duration_seconds_sum", "tandem_inference_executions_total"):
        assert family in one


def test_following_a_training_jobs_checkpoints_hot_swaps_each_new_one_and_logs_every_swap(served, tmp_path, caplog):
    """Each load is one line on the server's logger (stderr under tandem serve): the first, each followed swap
    (from which checkpoint to which, load and warm-up times); a followed checkpoint that fails to load is a
    warning, and the old model keeps serving."""
    caplog.set_level(logging.INFO, logger="tandem.serve")
    directory = tmp_path / "checkpoints"
    first = write_checkpoint(directory, seed=1, step=10)
    pool = make_pool(model={"fromTrainingJob": {"name": "digits-train", "follow": True}})
    server = served(pool, str(directory), follow_interval=0.05)
    client = triton.InferenceServerClient(server.url)
    x = inputs(2)
    np.testing.assert_allclose(infer(client, x), reference(x, seed=1), rtol=1e-5, atol=1e-6)
    newest = write_checkpoint(directory, seed=2, step=20)
    wait_until(lambda: server.server.model.loaded.checkpoint == str(newest), what="the new checkpoint served")
    np.testing.assert_allclose(infer(client, x), reference(x, seed=2), rtol=1e-5, atol=1e-6)
    assert client.get_model_repository_index()[0]["reason"] == str(newest)
    parameters = client.get_model_metadata("digits")["parameters"]
    assert (parameters["checkpoint"], parameters["source"]) == (str(newest), "fromTrainingJob/digits-train")
    broken = directory / "step-00000030.pt"  # a newer name, not a checkpoint
    broken.write_text("not a checkpoint")
    wait_until(lambda: any(r.levelno == logging.WARNING for r in caplog.records), what="the failed load's warning")
    np.testing.assert_allclose(infer(client, x), reference(x, seed=2), rtol=1e-5, atol=1e-6)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "tandem.serve"]
    seconds = r"\d+\.\d\d s"
    old, new, followed = (re.escape(str(path)) for path in (first, newest, directory))
    assert re.fullmatch(rf"loaded digits from {old} in {seconds}, warm-up {seconds}", lines[0][1]), lines
    swaps = [message for _, message in lines if message.startswith("swapped")]
    assert len(swaps) == 1 and re.fullmatch(
        rf"swapped digits from {old} to {new} \(followed {followed}\): loaded in {seconds}, warm-up {seconds}",
        swaps[0]), lines
    warnings = [message for level, message in lines if level == "WARNING"]
    assert warnings == [f"not swapping digits to followed checkpoint {broken}, still serving {newest}: {broken}: not "
                        "a Tandem checkpoint: not a zip archive as torch.save writes (another kind of file, or a "
                        "truncated or corrupt checkpoint)"]


def test_a_pool_that_cannot_be_served_is_refused_with_the_reason(tmp_path, capsys):
    with pytest.raises(ModelLoadError, match="pass --checkpoint"):
        InferenceServer(make_pool(model={"fromTrainingJob": {"name": "digits-train"}}))
    manifest = tmp_path / "pool.yaml"
    manifest.write_text(json.dumps(make_pool(model={"callable": "inference_models:seeded_mlp"}).to_dict()))
    assert cli_main(["serve", str(manifest), "--port", "0"]) == 1
    assert "model.inputShape is required with model.callable" in capsys.readouterr().err


def test_tandem_serve_without_a_file_serves_the_pool_at_tandem_spec(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TANDEM_SPEC", raising=False)
    assert cli_main(["serve", "--port", "0"]) == 2
    assert "set TANDEM_SPEC" in capsys.readouterr().err
    spec = tmp_path / "pool.json"  # the whole resource as JSON, as the worker contract has it
    spec.write_text(json.dumps(make_pool(model={"callable": "inference_models:seeded_mlp"}).to_dict()))
    monkeypatch.setenv("TANDEM_SPEC", str(spec))
    assert cli_main(["serve", "--port", "0"]) == 1  # read from TANDEM_SPEC, and refused with the pool's problem
    assert "model.inputShape is required with model.callable" in capsys.readouterr().err


def test_sigterm_turns_not_ready_finishes_requests_in_flight_and_exits_0(tmp_path):
    gate = tmp_path / "open"
    manifest = tmp_path / "pool.yaml"
    manifest.write_text(json.dumps(make_pool(
        "drain", model={"callable": "inference_models:file_gated_mlp", "args": {"gate": str(gate)}, "inputShape": [64]},
        workersPerReplica=1, batchLimit=1).to_dict()))
    process = serve_process(manifest, "--grace-period", "120")
    try:
        port = port_from_log(process)
        wait_until(lambda: request(port, "GET", "/v2/health/ready")[0] == 200, what="ready")
        held = np.ones((1, 64), np.float32)  # inputs of all ones wait for the gate file
        pool = ThreadPoolExecutor(3)
        futures = [pool.submit(infer_in_thread, f"127.0.0.1:{port}", held, "drain") for _ in range(3)]
        wait_until(lambda: 'tandem_inference_pending_requests{model="drain"} 3.0'
                   in request(port, "GET", "/metrics")[2].decode(), what="three requests in flight")
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: request(port, "GET", "/v2/health/ready")[0] == 503, what="not ready")
        status, _, body = request(port, "POST", "/v2/models/drain/infer", json_body(inputs(1)))
        assert status == 503 and "shutting down" in json.loads(body)["error"]
        assert process.poll() is None  # still draining
        gate.touch()
        for future in futures:
            np.testing.assert_allclose(future.result(WAIT_S), reference(held), rtol=1e-5, atol=1e-6)
        pool.shutdown()
        assert process.wait(WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "finishing requests already received" in process.stderr.read()


def test_a_drain_past_its_grace_period_answers_503_and_exits_0_right_after_it(tmp_path):
    """SIGTERM with requests in flight on a model slower than the grace period (its forward never ends): the
    running request and those queued behind it get 503 when the grace period ends, and the process exits 0 at
    once (a forward cannot be interrupted; the server does not wait for it)."""
    grace = 1.0
    manifest = tmp_path / "pool.yaml"
    manifest.write_text(json.dumps(make_pool(
        "stuck", model={"callable": "inference_models:file_gated_mlp", "args": {"gate": str(tmp_path / "never")},
                        "inputShape": [64]},
        workersPerReplica=1, batchLimit=1).to_dict()))
    process = serve_process(manifest, "--grace-period", str(grace))
    try:
        port = port_from_log(process)
        wait_until(lambda: request(port, "GET", "/v2/health/ready")[0] == 200, what="ready")
        held = json_body(np.ones((1, 64), np.float32))  # inputs of all ones wait for the gate file: forever
        pool = ThreadPoolExecutor(3)
        futures = [pool.submit(request, port, "POST", "/v2/models/stuck/infer", held, timeout=WAIT_S)
                   for _ in range(3)]
        wait_until(lambda: 'tandem_inference_pending_requests{model="stuck"} 3.0'
                   in request(port, "GET", "/metrics")[2].decode(), what="three requests in flight")
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        # The bound is the grace period plus process teardown (measured: exit 1.1 s after SIGTERM with a 1 s
        # grace period); it used to wait 10 s more for the stuck forward.
        assert process.wait(grace + 5) == 0
        assert time.monotonic() - signalled >= grace
        for future in futures:  # one running, two queued: all answered
            status, _, body = future.result(WAIT_S)
            assert (status, json.loads(body)) == (503, {"error": "the server stopped before this request was "
                                                                 f"answered (grace period of {grace:g} s over)"})
        pool.shutdown()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = process.stderr.read()
    assert "grace period over with 3 requests unanswered" in log and "stopped (some requests" in log


def batch_size_buckets(port: int, model: str = "digits") -> dict[str, float]:
    """The batch-size histogram's cumulative buckets from /metrics, by bound."""
    metrics = request(port, "GET", "/metrics")[2].decode()
    return {bound: float(count) for bound, count in re.findall(
        rf'tandem_inference_batch_size_bucket{{le="([^"]+)",model="{model}"}} (\S+)', metrics)}


def test_batching_changes_reach_a_running_server_under_load_and_fail_no_request(served):
    """A batching change (what a server following its pool makes, pool_watch.py) while eight clients keep sending:
    every request succeeds; the server reports the new settings (the endpoint, the model metadata's parameters,
    Triton's config, /metrics) and batches by them."""
    server = served(make_pool(workersPerReplica=2, queueLimit=256))
    path = "/v2/models/digits/batching"
    assert json.loads(request(server.port, "GET", path)[2]) == {
        "batchLimit": 32, "queueLimit": 256, "maxQueueDelayMicroseconds": 0, "requestTimeoutMs": 30000}
    x = inputs(8, seed=4)
    expected = reference(x)
    stop = threading.Event()
    failures, answered = [], [0]

    def client(index: int) -> None:
        connection = triton.InferenceServerClient(server.url)
        while not stop.is_set():
            try:
                y = infer(connection, x[index:index + 1])
            except Exception as error:  # recorded: the test asserts there are none
                failures.append(error)
                return
            if not np.allclose(y, expected[index:index + 1], rtol=1e-5, atol=1e-6):
                failures.append(AssertionError(f"client {index} got another request's output"))
            answered[0] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: answered[0] >= 50, WAIT_S, "the clients to get answers")
        server.update_batching(BatchingSettings(batchLimit=48, queueLimit=256, maxQueueDelayMicroseconds=100))
        assert json.loads(request(server.port, "GET", path)[2])["batchLimit"] == 48
        server.update_batching(BatchingSettings(batchLimit=2, queueLimit=256, maxQueueDelayMicroseconds=100,
                                                requestTimeoutMs=20000))
        assert json.loads(request(server.port, "GET", path)[2]) == {
            "batchLimit": 2, "queueLimit": 256, "maxQueueDelayMicroseconds": 100, "requestTimeoutMs": 20000}
        before = batch_size_buckets(server.port)
        answered_before = answered[0]
        wait_until(lambda: answered[0] >= answered_before + 100, WAIT_S, "answers under the new batching")
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_S)
    assert failures == [] and answered[0] > 150, failures[:3]
    after = batch_size_buckets(server.port)
    # 100 answers after the change: at most 8 of them (one per client) were batched before it, and at most 16 more
    # in the two batches the workers may have taken before it; the others came in batches of at most 2.
    assert after["2.0"] - before["2.0"] >= (100 - 8 - 16) / 2, "batches of the new limit"
    assert after["+Inf"] - after["2.0"] - (before["+Inf"] - before["2.0"]) <= 2, \
        "only batches the two workers had taken before the change may be larger"
    assert {"32.0", "48.0"} <= after.keys(), "a bucket for every limit run with, so no count moves between buckets"

    metadata = json.loads(request(server.port, "GET", "/v2/models/digits")[2])["parameters"]
    assert {k: metadata[k] for k in ("batch_limit", "queue_limit", "max_queue_delay_microseconds",
                                     "request_timeout_ms")} == {
        "batch_limit": 2, "queue_limit": 256, "max_queue_delay_microseconds": 100, "request_timeout_ms": 20000}
    metrics = request(server.port, "GET", "/metrics")[2].decode()
    assert 'tandem_inference_batch_limit{model="digits"} 2.0' in metrics
    assert 'tandem_inference_max_queue_delay_seconds{model="digits"} 0.0001' in metrics
    assert 'tandem_inference_request_timeout_seconds{model="digits"} 20.0' in metrics
    config = json.loads(request(server.port, "GET", "/v2/models/digits/config")[2])
    assert config["max_batch_size"] == 2 and config["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    status, _, body = request(server.port, "POST", "/v2/models/digits/infer", json_body(inputs(3)))
    assert status == 400 and "outside 1..2" in json.loads(body)["error"], "a request may carry the new limit at most"
    server.update_batching(BatchingSettings(batchLimit=2000, queueLimit=256))
    big = inputs(1500, seed=6)  # over the old limits, and as JSON over the body limit (1 MiB) the old ones gave
    np.testing.assert_allclose(infer(triton.InferenceServerClient(server.url), big, binary=False), reference(big),
                               rtol=1e-5, atol=1e-6)


def test_no_port_takes_a_batching_change(served):
    """No control endpoint on the data port (issue 35): the batching settings are read only over HTTP, a PUT is
    answered as any method a path does not take, and a server not started with --watch-pool keeps its manifest's."""
    server = served(make_pool())
    assert server.server.pool_watch is None, "tandem serve without --watch-pool reads no pool"
    for method in ("PUT", "POST", "PATCH", "DELETE"):
        assert request(server.port, method, "/v2/models/digits/batching", b'{"batchLimit": 1}')[0] == 405, method
    assert request(server.port, "PUT", "/v2/models/other/batching", b"{}")[0] in (404, 405)
    assert json.loads(request(server.port, "GET", "/v2/models/digits/batching")[2]) == {
        "batchLimit": 32, "queueLimit": 64, "maxQueueDelayMicroseconds": 0, "requestTimeoutMs": 30000}


def test_a_batch_limit_the_model_cannot_run_is_refused_and_the_server_keeps_its_settings(served):
    model = {"callable": "inference_models:at_most", "args": {"rows": 4}, "inputShape": [64]}
    server = served(make_pool(model=model, batchLimit=4))
    with pytest.raises(BatchingRefused, match="fails its warm-up at the new batch sizes: RuntimeError: this model "
                                              "takes at most 4 examples, not 8"):
        server.update_batching(BatchingSettings(batchLimit=8))
    assert json.loads(request(server.port, "GET", "/v2/models/digits/batching")[2])["batchLimit"] == 4
    server.update_batching(BatchingSettings(batchLimit=2))
    assert json.loads(request(server.port, "GET", "/v2/models/digits/batching")[2])["batchLimit"] == 2
    assert infer(triton.InferenceServerClient(server.url), inputs(2)).shape == (2, 10)


def test_behind_the_pools_token_the_batching_settings_need_it_and_readiness_reports_them(served, tmp_path):
    token = tmp_path / "token"
    token.write_text("batching-token\n")
    server = served(make_pool(auth={"secretName": "digits-token"}), auth_token_file=str(token))
    path, change = "/v2/models/digits/batching", b'{"batchLimit": 4}'
    assert request(server.port, "PUT", path, change)[0] == 401
    assert request(server.port, "GET", path)[0] == 401
    assert json.loads(request(server.port, "GET", "/v2/models/digits/ready")[2])["parameters"]["batch_limit"] == 32, \
        "readiness, open for the operator, reports the batching"
    bearer = {"Authorization": "Bearer batching-token"}
    assert request(server.port, "PUT", path, change, bearer)[0] == 405, "not even the token's holders change them"
    assert json.loads(request(server.port, "GET", path, headers=bearer)[2])["batchLimit"] == 32


def test_a_new_request_timeout_applies_to_new_requests_and_pending_ones_keep_theirs(served):
    name = "timeout-change"
    server = served(gated_pool(name, workersPerReplica=1, batchLimit=1, requestTimeoutMs=600_000))
    gate = GATES[name]
    pool = ThreadPoolExecutor(2)
    gate.close()
    running = pool.submit(request, server.port, "POST", f"/v2/models/{name}/infer", json_body(inputs(1)))
    gate.wait_entered(1)
    server.update_batching(server.server.model.batching.model_copy(update={"request_timeout_ms": 200}))
    # bounded: a server that kept the old timeout fails here instead of waiting for the gate
    status, _, body = request(server.port, "POST", f"/v2/models/{name}/infer", json_body(inputs(1, seed=2)),
                              timeout=10)
    assert (status, json.loads(body)["error"]) == (504, "no output within the pool's requestTimeoutMs of 200 ms")
    assert not running.done(), "the request sent before the change keeps its 10-minute deadline"
    gate.open.set()
    assert running.result(WAIT_S)[0] == 200
    pool.shutdown()
