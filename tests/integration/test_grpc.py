"""The inference server's gRPC service (inference.GRPCInferenceService) over real sockets on 127.0.0.1, with
tritonclient.grpc as the client (the generated stub where a test sends what tritonclient never does), and the
pool's bearer token over HTTP and gRPC. Requests are held at a known point with a gate, never with sleeps."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from inference_models import GATES, Forward
from serving import (
    WAIT_S,
    fill_the_queue,
    gated_pool,
    infer_in_thread,
    inputs,
    json_body,
    make_pool,
    reference,
    request,
    wait_until,
    write_checkpoint,
)
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tandem.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("http_front")  # every test here, under both fronts (conftest.py)

TOKEN = "s3cret-token"


def grpc_infer(client: tgrpc.InferenceServerClient, x: np.ndarray, model: str = "digits", datatype: str = "FP32",
               **kwargs) -> np.ndarray:
    tensor = tgrpc.InferInput("input", list(x.shape), datatype)
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor], **kwargs).as_numpy("output")


def grpc_infer_in_thread(url: str, x: np.ndarray, model: str, **kwargs) -> np.ndarray:
    client = tgrpc.InferenceServerClient(url)
    try:
        return grpc_infer(client, x, model, **kwargs)
    finally:
        client.close()


def status_of(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as raised:
        call()
    return raised.value


def test_tritonclient_grpc_health_metadata_config_statistics_and_index(served):
    server = served(make_pool(workersPerReplica=2, maxQueueDelayMicroseconds=100), grpc=True)
    client = tgrpc.InferenceServerClient(server.grpc_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits") and client.is_model_ready("digits", "1")
    metadata = client.get_server_metadata(as_json=True)
    assert metadata["name"] == "tandem" and "statistics" in metadata["extensions"]
    model = client.get_model_metadata("digits", "1", as_json=True)
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "64"]}]
    assert model["outputs"] == [{"name": "output", "datatype": "FP32", "shape": ["-1", "10"]}]
    config = client.get_model_config("digits").config
    assert config.max_batch_size == 32 and list(config.input[0].dims) == [64]
    assert config.dynamic_batching.max_queue_delay_microseconds == 100 and config.instance_group[0].count == 2
    x = inputs(3)
    result = client.infer("digits", [_input(x)], request_id="g-1")
    assert result.get_response().id == "g-1"
    np.testing.assert_allclose(result.as_numpy("output"), reference(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grpc_infer(client, x[:1], model_version="1"), reference(x[:1]), rtol=1e-5, atol=1e-6)
    # the same counters as HTTP's statistics extension
    stats = client.get_inference_statistics("digits", as_json=True)["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == "2" and stats["inference_count"] == "4"
    assert stats == _integers_as_strings(thttp.InferenceServerClient(server.url).get_inference_statistics(
        "digits")["model_stats"][0], stats)
    assert client.get_inference_statistics(as_json=True)["model_stats"][0]["name"] == "digits"
    assert client.get_model_repository_index(as_json=True)["models"] == [
        {"name": "digits", "version": "1", "state": "READY", "reason": "callable"}]
    assert request(server.port, "GET", "/metrics")[2].count(b'outcome="success"} 2.0') == 1
    client.close()


def _input(x: np.ndarray, datatype: str = "FP32") -> tgrpc.InferInput:
    tensor = tgrpc.InferInput("input", list(x.shape), datatype)
    tensor.set_data_from_numpy(x)
    return tensor


def _integers_as_strings(http_stats: dict, like: dict) -> dict:
    """HTTP's statistics as protobuf's JSON writes them (int64 as strings, zero counters left out), keeping only
    the fields the message has."""
    def convert(value, shape):
        if isinstance(value, dict):
            return {k: convert(v, shape[k]) for k, v in value.items() if k in shape}
        if isinstance(value, list):
            return [convert(v, shape[0]) for v in value]
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    return convert(http_stats, like)


@pytest.mark.parametrize(("datatype", "shape", "numpy_type"), [
    ("FP32", [4], np.float32),
    ("FP16", [2, 3], np.float16),
    ("FP64", [3], np.float64),
    ("INT32", [5], np.int32),
    ("INT64", [1], np.int64),
    ("UINT8", [2, 2], np.uint8),
])
def test_infer_in_several_shapes_and_dtypes_raw_and_typed(served, datatype, shape, numpy_type):
    """A recorder model (every row answered with its first value, in the input's dtype) served with each datatype
    and per-example shape: batches of 1 to 3 come back row for row, as raw contents (tritonclient) and as typed
    contents (the stub) where the protocol has them."""
    name = f"typed-{datatype.lower()}"
    GATES.pop(name, None)
    server = served(make_pool(name, model={"callable": "inference_models:recorder", "args": {"name": name},
                                           "inputShape": shape, "inputDatatype": datatype}), grpc=True)
    client = tgrpc.InferenceServerClient(server.grpc_url)
    metadata = client.get_model_metadata(name, as_json=True)
    assert metadata["inputs"][0]["datatype"] == datatype
    for rows in (1, 3):
        x = np.stack([np.full(shape, row + 1, numpy_type) for row in range(rows)])
        output = grpc_infer(client, x, name, datatype)
        assert output.dtype == numpy_type
        np.testing.assert_array_equal(output, np.arange(1, rows + 1, dtype=numpy_type).reshape(rows, 1))
    client.close()
    if datatype == "FP16":
        return  # no typed contents for FP16: the next test shows the refusal
    field = {"FP32": "fp32_contents", "FP64": "fp64_contents", "INT32": "int_contents", "INT64": "int64_contents",
             "UINT8": "uint_contents"}[datatype]
    x = np.stack([np.full(shape, 7, numpy_type), np.full(shape, 9, numpy_type)])
    typed = service_pb2.ModelInferRequest(model_name=name)
    tensor = typed.inputs.add(name="input", datatype=datatype, shape=list(x.shape))
    getattr(tensor.contents, field).extend(x.ravel().tolist())
    with grpc.insecure_channel(server.grpc_url) as channel:
        answer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(typed, timeout=WAIT_S)
    assert list(answer.outputs[0].shape) == [2, 1] and answer.outputs[0].datatype == datatype
    np.testing.assert_array_equal(np.frombuffer(answer.raw_output_contents[0], numpy_type), [7, 9])


def test_concurrent_clients_each_get_their_own_rows(served):
    server = served(make_pool(workersPerReplica=2, queueLimit=256), grpc=True)
    x = inputs(48, seed=3)
    slices = [(i, 1 + i % 4) for i in range(0, 40, 4)]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(grpc_infer_in_thread, server.grpc_url, x[i:i + n], "digits") for i, n in slices * 3]
        outputs = [future.result(WAIT_S) for future in futures]
    for (i, n), output in zip(slices * 3, outputs, strict=True):
        np.testing.assert_allclose(output, reference(x[i:i + n]), rtol=1e-5, atol=1e-6)


def test_grpc_and_http_requests_queued_together_share_one_forward(served):
    """One batching engine behind both ports: requests queued behind a running forward, whichever port they came
    by, run as the next batch, and each gets its own rows back. Every value of a request's input is its id."""
    name = "both-ports"
    GATES.pop(name, None)
    server = served(make_pool(name, model={"callable": "inference_models:recorder", "args": {"name": name},
                                           "inputShape": [4]}, workersPerReplica=1), grpc=True)
    gate, inference = GATES[name], server.server.model.inference
    sizes = {1: 1, 2: 2, 3: 1, 4: 3}  # request id: examples; odd ids by HTTP, even by gRPC
    pool = ThreadPoolExecutor(len(sizes))
    gate.close()
    futures = {}
    for request_id, rows in sizes.items():
        x = np.full((rows, 4), request_id, np.float32)
        futures[request_id] = pool.submit(infer_in_thread, server.url, x, name) if request_id % 2 else \
            pool.submit(grpc_infer_in_thread, server.grpc_url, x, name)
        if request_id == 1:
            gate.wait_entered(1)
        else:
            wait_until(lambda count=request_id - 1: inference.queued == count, what=f"{request_id - 1} queued")
    gate.open.set()
    for request_id, rows in sizes.items():
        np.testing.assert_array_equal(futures[request_id].result(WAIT_S), np.full((rows, 1), request_id, np.float32))
    pool.shutdown()
    # in one forward: in order of arrival within each queue (the C front's and the Python server's, whose heads are
    # taken oldest first), so the order across them depends on which front serves which port
    first, second = gate.forwards
    assert first == Forward((1,), (4,), torch.float32)
    assert sorted(second.ids) == [2, 2, 3, 4, 4, 4] and (second.shape, second.dtype) == ((4,), torch.float32)


def test_a_drain_answers_new_grpc_calls_unavailable_and_finishes_the_ones_it_has(served):
    name = "grpc-drain"
    server = served(gated_pool(name, workersPerReplica=1), grpc=True)
    gate = GATES[name]
    pool = ThreadPoolExecutor(2)
    gate.close()
    held = pool.submit(grpc_infer_in_thread, server.grpc_url, inputs(1), name)
    gate.wait_entered(1)
    client = tgrpc.InferenceServerClient(server.grpc_url)
    draining = pool.submit(server.drain, 60.0)
    wait_until(lambda: server.server.draining, what="draining")
    refused = status_of(lambda: grpc_infer(client, inputs(1), name))
    assert refused.status() == "StatusCode.UNAVAILABLE" and "shutting down" in refused.message()
    assert not client.is_server_ready(), "not ready while draining"
    gate.open.set()
    np.testing.assert_allclose(held.result(WAIT_S), reference(inputs(1)), rtol=1e-5, atol=1e-6)
    assert draining.result(WAIT_S) is True, "every request answered within the grace period"
    pool.shutdown()
    client.close()


@pytest.mark.parametrize(("mutate", "code", "words"), [
    (lambda r: setattr(r, "model_name", "other"), "NOT_FOUND", "unknown model 'other': this server serves 'digits'"),
    (lambda r: setattr(r, "model_version", "7"), "NOT_FOUND", "has no version '7'"),
    (lambda r: setattr(r.inputs[0], "name", "x"), "INVALID_ARGUMENT", "unknown input 'x'"),
    (lambda r: setattr(r.inputs[0], "datatype", "INT64"), "INVALID_ARGUMENT",
     "datatype 'INT64' does not match the model's FP32"),
    (lambda r: r.inputs[0].shape.__setitem__(1, 63), "INVALID_ARGUMENT", "shape [2, 63] does not match"),
    (lambda r: r.inputs[0].shape.__setitem__(0, 33), "INVALID_ARGUMENT", "batch size 33 is outside 1..32"),
    (lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 12), "INVALID_ARGUMENT",
     "raw_input_contents[0] holds 12 bytes; shape [2, 64] of FP32 needs 512"),
    (lambda r: r.inputs[0].contents.fp32_contents.append(1.0), "INVALID_ARGUMENT",
     "give either contents or raw_input_contents"),
    (lambda r: r.ClearField("raw_input_contents"), "INVALID_ARGUMENT", "no data (give raw_input_contents"),
    (lambda r: r.outputs.add(name="logits"), "INVALID_ARGUMENT", "unknown output 'logits'"),
    (lambda r: r.parameters["timeout"].__setattr__("string_param", "soon"), "INVALID_ARGUMENT",
     "parameters.timeout must be a non-negative int64_param"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_requests_get_a_status_code_and_a_message_naming_the_field(served, mutate, code, words):
    server = served(make_pool(), grpc=True)
    request_message = service_pb2.ModelInferRequest(model_name="digits")
    request_message.inputs.add(name="input", datatype="FP32", shape=[2, 64])
    request_message.raw_input_contents.append(inputs(2).tobytes())
    mutate(request_message)
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request_message, timeout=WAIT_S)
        assert (refused.value.code().name, words in refused.value.details()) == (code, True), refused.value.details()
        assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=WAIT_S).live, "the server lives on"


def test_a_full_queue_is_resource_exhausted_and_every_accepted_request_succeeds(served):
    name = "grpc-queue-full"
    server = served(gated_pool(name, workersPerReplica=1, batchLimit=1, queueLimit=4), grpc=True)
    gate = GATES[name]
    x = inputs(5)
    pool, accepted = fill_the_queue(name, server.server.model.inference,
                                    lambda i: grpc_infer_in_thread(server.grpc_url, x[i:i + 1], name))
    client = tgrpc.InferenceServerClient(server.grpc_url)
    rejected = status_of(lambda: grpc_infer(client, x[:1], name))
    assert rejected.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "queue full: 4 requests already waiting" in rejected.message()
    gate.open.set()
    np.testing.assert_allclose(np.concatenate([f.result(WAIT_S) for f in accepted]), reference(x), rtol=1e-5,
                               atol=1e-6)
    pool.shutdown()
    metrics = request(server.port, "GET", "/metrics")[2].decode()
    assert f'tandem_inference_requests_total{{model="{name}",outcome="rejected"}} 1.0' in metrics
    assert f'tandem_inference_requests_total{{model="{name}",outcome="success"}} 5.0' in metrics
    client.close()


@pytest.mark.parametrize(("pool_spec", "call", "words"), [
    ({}, {"client_timeout": 0.2}, None),  # the client's gRPC deadline
    ({}, {"timeout": 20_000}, "the request's timeout of 20 ms"),  # parameters.timeout, microseconds
    ({"requestTimeoutMs": 200}, {}, "no output within the pool's requestTimeoutMs of 200 ms"),
], ids=["grpc-deadline", "request-timeout", "pool-timeout"])
def test_a_deadline_is_deadline_exceeded_and_the_request_leaves_the_queue(served, pool_spec, call, words):
    name = "grpc-deadline"
    server = served(gated_pool(name, workersPerReplica=1, batchLimit=1, **pool_spec), grpc=True)
    gate, inference = GATES[name], server.server.model.inference
    pool = ThreadPoolExecutor(1)
    gate.close()
    running = pool.submit(grpc_infer_in_thread, server.grpc_url, inputs(1), name)
    gate.wait_entered(1)
    client = tgrpc.InferenceServerClient(server.grpc_url)
    timed_out = status_of(lambda: grpc_infer(client, inputs(1, seed=2), name, **call))
    assert timed_out.status() == "StatusCode.DEADLINE_EXCEEDED", timed_out
    if words is not None:
        assert words in timed_out.message()
    wait_until(lambda: inference.queued == 0 and server.server.pending.count <= 1, what="the request withdrawn")
    gate.open.set()
    if not pool_spec:
        np.testing.assert_allclose(running.result(WAIT_S), reference(inputs(1)), rtol=1e-5, atol=1e-6)
    pool.shutdown()
    client.close()


def test_a_call_its_client_cancels_leaves_the_queue_then_not_at_its_deadline(served):
    """A call cancelled by its client (RST_STREAM) while its request waits behind a held forward is withdrawn from the
    queue at once: the pool's requestTimeoutMs is a minute, so only the cancellation can take it out."""
    name = "grpc-cancel"
    server = served(gated_pool(name, workersPerReplica=1, batchLimit=1, requestTimeoutMs=60_000), grpc=True)
    gate, inference = GATES[name], server.server.model.inference
    pool = ThreadPoolExecutor(1)
    gate.close()
    running = pool.submit(grpc_infer_in_thread, server.grpc_url, inputs(1), name)
    gate.wait_entered(1)
    cancelled = service_pb2.ModelInferRequest(model_name=name)
    cancelled.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    cancelled.raw_input_contents.append(inputs(1, seed=2).tobytes())
    with grpc.insecure_channel(server.grpc_url) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer.future(cancelled)
        wait_until(lambda: inference.queued == 1, what="the second call queued behind the held forward")
        call.cancel()
        wait_until(lambda: inference.queued == 0 and server.server.pending_count == 1,
                   what="the cancelled call withdrawn")
    gate.open.set()
    np.testing.assert_allclose(running.result(WAIT_S), reference(inputs(1)), rtol=1e-5, atol=1e-6)
    pool.shutdown()


def test_repository_loads_are_under_the_same_lockdown_as_http(served, tmp_path):
    repo = tmp_path / "models" / "digits"
    good = write_checkpoint(repo, seed=1, step=1)
    locked = served(make_pool(model={"checkpoint": str(good)}), grpc=True)
    client = tgrpc.InferenceServerClient(locked.grpc_url)
    refused = status_of(lambda: client.load_model("digits", config=json.dumps({"checkpoint": str(good)})))
    assert refused.status() == "StatusCode.PERMISSION_DENIED"
    assert "set spec.modelRepository.load: true" in refused.message()
    assert status_of(lambda: client.unload_model("digits")).status() == "StatusCode.INVALID_ARGUMENT"
    client.close()

    server = served(make_pool(model={"checkpoint": str(good)}, modelRepository={"load": True}), grpc=True)
    client = tgrpc.InferenceServerClient(server.grpc_url)
    outside = write_checkpoint(tmp_path / "elsewhere", seed=3, step=3)
    refused = status_of(lambda: client.load_model("digits", config=json.dumps({"checkpoint": str(outside)})))
    assert refused.status() == "StatusCode.PERMISSION_DENIED" and "outside the model repository root" in \
        refused.message()
    missing = status_of(lambda: client.load_model("digits", config=json.dumps({"checkpoint": str(repo / "no.pt")})))
    assert missing.status() == "StatusCode.INVALID_ARGUMENT" and f"still serving {good}" in missing.message()
    newer = write_checkpoint(repo / "newer", seed=2, step=2)
    client.load_model("digits", config=json.dumps({"checkpoint": str(newer)}))
    x = inputs(2)
    np.testing.assert_allclose(grpc_infer(client, x), reference(x, seed=2), rtol=1e-5, atol=1e-6)
    client.close()


def _token_file(tmp_path, token: str = TOKEN):
    path = tmp_path / "token"
    path.write_text(token + "\n")
    return str(path)


@pytest.mark.parametrize("metrics", ["open", "protected"])
def test_with_a_token_http_answers_401_without_it_and_200_with_it_and_the_probes_stay_open(served, tmp_path,
                                                                                           metrics):
    pool = make_pool(auth={"secretName": "digits-token", "metrics": metrics})
    server = served(pool, grpc=True, auth_token_file=_token_file(tmp_path))
    x = inputs(2)
    infer_path = "/v2/models/digits/infer"
    status, headers, body = request(server.port, "POST", infer_path, json_body(x))
    assert (status, headers["WWW-Authenticate"]) == (401, 'Bearer realm="tandem"')
    assert "needs the pool's bearer token" in json.loads(body)["error"]
    status, _, body = request(server.port, "POST", infer_path, json_body(x), {"Authorization": "Bearer wrong"})
    assert status == 401 and "not the pool's" in json.loads(body)["error"]
    for path in ("/v2", "/v2/models/digits", "/v2/models/digits/config", "/v2/models/stats"):
        assert request(server.port, "GET", path)[0] == 401, path
    assert request(server.port, "POST", "/v2/repository/index")[0] == 401
    assert request(server.port, "POST", "/v2/repository/models/digits/load", b"")[0] == 401, "before the lockdown"
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/digits/ready"):
        assert request(server.port, "GET", path)[0] == 200, path
    assert request(server.port, "GET", "/metrics")[0] == (401 if metrics == "protected" else 200)
    authorized = {"Authorization": f"Bearer {TOKEN}"}
    assert request(server.port, "GET", "/metrics", headers=authorized)[0] == 200
    client = thttp.InferenceServerClient(server.url)
    tensor = thttp.InferInput("input", [2, 64], "FP32")
    tensor.set_data_from_numpy(x)
    answer = client.infer("digits", [tensor], headers=authorized).as_numpy("output")
    np.testing.assert_allclose(answer, reference(x), rtol=1e-5, atol=1e-6)
    assert client.get_model_metadata("digits", headers=authorized)["name"] == "digits"
    client.close()


def test_with_a_token_grpc_is_unauthenticated_without_it_and_answers_with_it_and_the_probes_stay_open(served,
                                                                                                      tmp_path):
    server = served(make_pool(auth={"secretName": "digits-token"}), grpc=True, auth_token_file=_token_file(tmp_path))
    client = tgrpc.InferenceServerClient(server.grpc_url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("digits")
    x = inputs(2)
    for call in (lambda: grpc_infer(client, x), lambda: client.get_model_metadata("digits"),
                 lambda: client.get_server_metadata(), lambda: client.get_inference_statistics(),
                 lambda: client.get_model_repository_index(), lambda: client.load_model("digits"),
                 lambda: grpc_infer(client, x, headers={"authorization": "Bearer wrong"})):
        refused = status_of(call)
        assert refused.status() == "StatusCode.UNAUTHENTICATED", refused
    authorized = {"authorization": f"Bearer {TOKEN}"}
    np.testing.assert_allclose(grpc_infer(client, x, headers=authorized), reference(x), rtol=1e-5, atol=1e-6)
    assert client.get_model_metadata("digits", headers=authorized).name == "digits"
    assert status_of(lambda: client.load_model("digits", headers=authorized)).status() == \
        "StatusCode.PERMISSION_DENIED", "past the token, the repository's own lockdown"
    _token_file(tmp_path, "rotated-token")  # the kubelet updating the mounted Secret: no restart
    assert status_of(lambda: grpc_infer(client, x, headers=authorized)).status() == "StatusCode.UNAUTHENTICATED"
    rotated = {"authorization": "Bearer rotated-token"}
    np.testing.assert_allclose(grpc_infer(client, x, headers=rotated), reference(x), rtol=1e-5, atol=1e-6)
    assert request(server.port, "GET", "/v2", headers={"Authorization": "Bearer rotated-token"})[0] == 200
    client.close()


def test_tandem_serve_refuses_a_pool_with_auth_and_no_token_file(tmp_path, capsys):
    manifest = tmp_path / "pool.yaml"
    manifest.write_text(json.dumps(make_pool(auth={"secretName": "digits-token"}).to_dict()))
    assert cli_main(["serve", str(manifest)]) == 1
    assert "give the token's file with --auth-token-file PATH" in capsys.readouterr().err
    assert cli_main(["serve", str(manifest), "--auth-token-file", str(tmp_path / "missing")]) == 1
    assert "the auth token file" in capsys.readouterr().err
