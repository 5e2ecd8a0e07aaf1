"""The Open Inference Protocol codec on its own: every datatype through JSON and binary tensors, both ways; and
Triton's shapes (model configuration, load requests)."""

from __future__ import annotations

import re

import numpy as np
import orjson
import pytest
import torch

from tandem.worker.serve import triton
from tandem.worker.serve.protocol import (
    DATATYPES,
    InferRequest,
    ProtocolError,
    Signature,
    TensorSpec,
    decode_request,
    encode_response,
)


def signature(datatype: str, shape=(3,)) -> Signature:
    return Signature(TensorSpec("input", datatype, shape), TensorSpec("output", datatype, shape), 4)


def values(datatype: str) -> torch.Tensor:
    if datatype == "BOOL":
        return torch.tensor([[True, False, True], [False, False, True]])
    return torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=DATATYPES[datatype][0])


def as_tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x))


@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_every_datatype_round_trips_through_json_and_binary_tensors(datatype):
    expected = values(datatype)
    sig = signature(datatype)
    as_json = {"inputs": [{"name": "input", "shape": [2, 3], "datatype": datatype,
                           "data": expected.float().tolist() if datatype in ("FP16", "BF16") else expected.tolist()}]}
    decoded = decode_request(orjson.dumps(as_json), None, sig)
    assert torch.equal(as_tensor(decoded.x), expected)
    raw = (expected.view(torch.int16) if datatype == "BF16" else expected).numpy().tobytes()
    header = orjson.dumps({"inputs": [{"name": "input", "shape": [2, 3], "datatype": datatype,
                                       "parameters": {"binary_data_size": len(raw)}}],
                           "outputs": [{"name": "output", "parameters": {"binary_data": True}}]})
    decoded = decode_request(header + raw, str(len(header)), sig)
    assert torch.equal(as_tensor(decoded.x), expected) and decoded.binary_output
    output = expected if datatype == "BF16" else expected.numpy()
    body, content_type, length = encode_response(output, decoded, "m", "1", sig)
    assert content_type == "application/octet-stream" and body[length:] == raw
    assert orjson.loads(body[:length])["outputs"][0] == {
        "name": "output", "datatype": datatype, "shape": [2, 3], "parameters": {"binary_data_size": len(raw)}}
    body, content_type, length = encode_response(output, InferRequest(None, "req-7", False, None), "m", "1", sig)
    answer = orjson.loads(body)
    assert length is None and answer["id"] == "req-7"
    assert answer["outputs"][0]["data"] == expected.reshape(-1).tolist()


@pytest.mark.parametrize(("datatype", "data", "message"), [
    ("INT8", [1, 2, 300], r"INT8 data out of range \(-128..127\): found 1..300"),
    ("UINT8", [1, -2, 3], "UINT8 data out of range"),
    ("INT32", [1.5, 2, 3], "INT32 data must be integers; found non-integer numbers"),
    ("BOOL", [1, 0, 1], "BOOL data must be true/false; found integers"),
    ("FP32", [True, False, True], "FP32 data must be numbers; found true/false"),
    ("FP32", [1, None, 3], "FP32 data must be numbers; found values of mixed types"),
    ("FP32", {"a": 1}, "data must be a list of numbers; got an object"),
])
def test_json_data_of_the_wrong_kind_is_named(datatype, data, message):
    body = orjson.dumps({"inputs": [{"name": "input", "shape": [1, 3], "datatype": datatype, "data": data}]})
    with pytest.raises(ProtocolError, match=message):
        decode_request(body, None, signature(datatype))


def test_a_body_after_the_json_without_binary_inputs_is_refused():
    header = orjson.dumps({"inputs": [{"name": "input", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]})
    with pytest.raises(ProtocolError, match="12 bytes after the JSON header but no input has"):
        decode_request(header + bytes(12), str(len(header)), signature("FP32"))


def test_metadata_and_config_shapes():
    sig = signature("FP32", (8, 8))
    assert sig.metadata("m", ["1"])["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 8, 8]}]
    config = triton.model_config(sig, "m", instances=2, kind="KIND_CPU", max_queue_delay_us=500, preferred=[4],
                                 queue_limit=64, timeout_us=1000)
    assert config["max_batch_size"] == 4 and config["input"][0]["dims"] == [8, 8]
    assert config["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 64


@pytest.mark.parametrize(("body", "checkpoint"), [
    (b"", None),
    (b'{"parameters": {"checkpoint": "/c/step-1.pt"}}', "/c/step-1.pt"),
    (b'{"parameters": {"config": "{\\"checkpoint\\": \\"/c\\"}"}}', "/c"),  # tritonclient's load_model(config=...)
])
def test_a_load_request_names_a_checkpoint_or_reloads(body, checkpoint):
    assert triton.load_request_checkpoint(body) == checkpoint


@pytest.mark.parametrize(("body", "words"), [
    (b"{nope", "malformed JSON in the load request"),
    (b'{"parameters": {"files": {}}}', "unknown load parameter(s) files"),
    (b'{"parameters": {"config": "[]"}}', "parameters.config must be a JSON object"),
    (b'{"parameters": {"checkpoint": 3}}', "parameters.checkpoint must be a path"),
])
def test_a_bad_load_request_says_what_is_wrong(body, words):
    with pytest.raises(ProtocolError, match=re.escape(words)):
        triton.load_request_checkpoint(body)
