"""The Open Inference Protocol over gRPC on the wire (`inference.GRPCInferenceService`, Triton's and KServe's
grpc_service.proto, with the generated messages tritonclient ships): inference requests decoded and validated with
protocol.py's checks into the same InferRequest as HTTP's, answers with `raw_output_contents` as tritonclient reads
them, the JSON shapes of metadata, configuration and statistics turned into their messages, and HTTP statuses into
gRPC status codes.

Pure functions over messages (no server, no model): the gRPC service calls them, tests call them directly. Like
protocol.py, every problem with a request raises ProtocolError naming the field.
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import torch
from google.protobuf import json_format
from google.protobuf.message import Message
from tritonclient.grpc import service_pb2

from tandem.worker.serve.protocol import (
    DATATYPES,
    ITEMSIZE,
    InferRequest,
    ProtocolError,
    Signature,
    check_tensor,
    listed_tensor,
    raw_tensor,
    tensor_bytes,
)

STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.UNIMPLEMENTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
"""The gRPC status code of each HTTP status the server answers with."""

# Datatype -> the field of InferTensorContents that carries it (FP16 and BF16 have none: raw contents only).
CONTENTS_FIELDS = {"BOOL": "bool_contents", "UINT8": "uint_contents", "INT8": "int_contents",
                   "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
                   "FP32": "fp32_contents", "FP64": "fp64_contents"}


def status_code(http_status: int) -> grpc.StatusCode:
    """The gRPC status code for an HTTP status (an unlisted 4xx is INVALID_ARGUMENT, 5xx INTERNAL)."""
    code = STATUS_CODES.get(http_status)
    if code is not None:
        return code
    return grpc.StatusCode.INTERNAL if http_status >= 500 else grpc.StatusCode.INVALID_ARGUMENT


def decode_infer_request(request: service_pb2.ModelInferRequest, signature: Signature) -> InferRequest:
    """Decode and validate a ModelInferRequest: its one input as `raw_input_contents` (tritonclient's way) or as
    typed `contents`, the outputs it asks for, and `parameters["timeout"]` (microseconds)."""
    expected = signature.input.name
    if len(request.inputs) != 1 or request.inputs[0].name != expected:
        names = [tensor.name for tensor in request.inputs]
        if not names:
            raise ProtocolError(f"the request needs inputs: the model's one input is {expected!r}")
        unknown = [name for name in names if name != expected]
        if unknown:
            raise ProtocolError(f"unknown input {unknown[0]!r}: the model's only input is {expected!r}")
        raise ProtocolError(f"input {expected!r} is given {len(names)} times")
    item = request.inputs[0]
    where = f"input {expected!r}"
    datatype, shape = item.datatype, list(item.shape)
    count = check_tensor(datatype, shape, signature, where)
    x = _input_tensor(request, item, datatype, shape, count, where)
    for index, output in enumerate(request.outputs):
        if output.name != signature.output.name:
            raise ProtocolError(f"outputs[{index}]: unknown output {output.name!r}: the model's only output is "
                                f"{signature.output.name!r}")
        if "classification" in output.parameters:
            raise ProtocolError("the classification extension (class_count) is not supported")
    timeout = None
    if "timeout" in request.parameters:
        parameter = request.parameters["timeout"]
        if parameter.WhichOneof("parameter_choice") not in ("int64_param", "uint64_param") \
                or _parameter_value(parameter) < 0:
            raise ProtocolError("parameters.timeout must be a non-negative int64_param (microseconds); got "
                                f"{_parameter_value(parameter)!r}")
        timeout = _parameter_value(parameter) or None
    return InferRequest(x, request.id or None, True, timeout)


def _input_tensor(request: service_pb2.ModelInferRequest, item: Any, datatype: str, shape: list[int], count: int,
                  where: str) -> np.ndarray | torch.Tensor:
    raws = request.raw_input_contents
    if raws:
        if item.HasField("contents"):
            raise ProtocolError(f"{where}: give either contents or raw_input_contents, not both")
        if len(raws) != 1:
            raise ProtocolError(f"raw_input_contents holds {len(raws)} tensors; the model has one input")
        size = count * ITEMSIZE[datatype]
        if len(raws[0]) != size:
            raise ProtocolError(f"{where}: raw_input_contents[0] holds {len(raws[0])} bytes; shape {shape} of "
                                f"{datatype} needs {size}")
        return raw_tensor(raws[0], datatype, shape)
    field = CONTENTS_FIELDS.get(datatype)
    if field is None:
        raise ProtocolError(f"{where}: {datatype} has no typed contents in the protocol; send it in "
                            "raw_input_contents")
    if not item.HasField("contents"):
        raise ProtocolError(f"{where}: no data (give raw_input_contents, or contents.{field})")
    torch_dtype, numpy_dtype = DATATYPES[datatype]
    return listed_tensor(list(getattr(item.contents, field)), shape, count, datatype, torch_dtype, numpy_dtype,
                         f"{where} contents.{field}")


def _parameter_value(parameter: Any) -> Any:
    choice = parameter.WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameter, choice)


def parameters_dict(parameters: Any) -> dict[str, Any]:
    """A map of InferParameter or ModelRepositoryParameter as plain values, keyed as sent."""
    return {key: _parameter_value(value) for key, value in parameters.items()}


def encode_infer_response(output: np.ndarray | torch.Tensor, request: InferRequest, model: str, version: str,
                          signature: Signature) -> service_pb2.ModelInferResponse:
    """The answer to `request` whose output is `output` (its rows of the model's output), in raw_output_contents."""
    spec = signature.output
    response = service_pb2.ModelInferResponse(model_name=model, model_version=version, id=request.id or "")
    response.outputs.add(name=spec.name, datatype=spec.datatype, shape=list(output.shape))
    response.raw_output_contents.append(tensor_bytes(output))
    return response


def message(shape: dict[str, Any] | list[Any], message_type: type[Message]) -> Message:
    """The message of `message_type` holding a JSON shape the HTTP endpoints answer with (field names as in the
    proto; fields the message lacks, such as metadata's parameters, are left out)."""
    return json_format.ParseDict(shape, message_type(), ignore_unknown_fields=True)
