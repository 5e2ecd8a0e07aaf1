"""The gRPC wire (worker/serve/grpc_protocol.py) without a server: status codes, decoding and encoding."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from tandem.worker.serve.grpc_protocol import decode_infer_request, encode_infer_response, status_code
from tandem.worker.serve.protocol import ProtocolError, Signature, TensorSpec

SIGNATURE = Signature(TensorSpec("input", "INT32", (3,)), TensorSpec("output", "FP32", (2,)), max_batch_size=4)


@pytest.mark.parametrize(("http_status", "code"), [
    (400, grpc.StatusCode.INVALID_ARGUMENT),
    (401, grpc.StatusCode.UNAUTHENTICATED),
    (403, grpc.StatusCode.PERMISSION_DENIED),
    (404, grpc.StatusCode.NOT_FOUND),
    (405, grpc.StatusCode.UNIMPLEMENTED),
    (413, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (500, grpc.StatusCode.INTERNAL),
    (503, grpc.StatusCode.UNAVAILABLE),
    (504, grpc.StatusCode.DEADLINE_EXCEEDED),
    (418, grpc.StatusCode.INVALID_ARGUMENT),
    (502, grpc.StatusCode.INTERNAL),
])
def test_http_statuses_become_grpc_codes(http_status, code):
    assert status_code(http_status) is code


def infer_request(**contents) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="m", id="r")
    tensor = request.inputs.add(name="input", datatype="INT32", shape=[2, 3])
    if "raw" in contents:
        request.raw_input_contents.append(contents["raw"])
    if "ints" in contents:
        tensor.contents.int_contents.extend(contents["ints"])
    return request


def test_raw_and_typed_contents_decode_to_the_same_array():
    values = np.arange(6, dtype=np.int32).reshape(2, 3)
    raw = decode_infer_request(infer_request(raw=values.tobytes()), SIGNATURE)
    typed = decode_infer_request(infer_request(ints=values.ravel().tolist()), SIGNATURE)
    np.testing.assert_array_equal(raw.x, values)
    np.testing.assert_array_equal(typed.x, values)
    assert raw.id == "r" and raw.binary_output and raw.timeout_us is None


@pytest.mark.parametrize(("request_message", "words"), [
    (infer_request(ints=[1, 2, 3]), "contents.int_contents: data holds 3 values; shape [2, 3] needs 6"),
    (infer_request(raw=b"\0" * 20), "raw_input_contents[0] holds 20 bytes; shape [2, 3] of INT32 needs 24"),
    (service_pb2.ModelInferRequest(model_name="m"), "the request needs inputs: the model's one input is 'input'"),
], ids=["count", "raw-size", "no-inputs"])
def test_bad_contents_are_refused_naming_the_field(request_message, words):
    with pytest.raises(ProtocolError) as refused:
        decode_infer_request(request_message, SIGNATURE)
    assert words in str(refused.value) and refused.value.status == 400


def test_typed_contents_out_of_the_datatypes_range_are_refused():
    int8 = Signature(TensorSpec("input", "INT8", (3,)), SIGNATURE.output, max_batch_size=4)
    request = infer_request(ints=[1, 2, 3, 4, 5, 300])
    request.inputs[0].datatype = "INT8"
    with pytest.raises(ProtocolError, match=r"contents.int_contents: INT8 data out of range \(-128..127\)"):
        decode_infer_request(request, int8)


def test_two_inputs_of_the_same_name_are_refused():
    request = infer_request(raw=b"\0" * 24)
    request.inputs.add(name="input", datatype="INT32", shape=[2, 3])
    with pytest.raises(ProtocolError, match="input 'input' is given 2 times"):
        decode_infer_request(request, SIGNATURE)


def test_the_answer_carries_the_output_as_raw_contents():
    decoded = decode_infer_request(infer_request(raw=b"\0" * 24), SIGNATURE)
    output = np.array([[1.5, 2.5], [3.5, 4.5]], np.float32)
    response = encode_infer_response(output, decoded, "m", "1", SIGNATURE)
    assert (response.model_name, response.model_version, response.id) == ("m", "1", "r")
    [tensor] = response.outputs
    assert (tensor.name, tensor.datatype, list(tensor.shape)) == ("output", "FP32", [2, 2])
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.float32), output.ravel())
