"""The Open Inference Protocol (KServe/Triton v2) on the wire: inference requests and responses as JSON tensors
and with Triton's binary tensor extension, and model metadata (Triton's other extensions: triton.py).

Pure functions over bytes and dicts (no HTTP, no model): the server calls them, tests call them directly.
Every problem with a request raises ProtocolError, whose message names the field and what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import torch

# Datatype name -> (torch dtype, numpy dtype used on the wire; None where numpy has no such type).
DATATYPES: dict[str, tuple[torch.dtype, Any]] = {
    "BOOL": (torch.bool, np.bool_),
    "UINT8": (torch.uint8, np.uint8),
    "INT8": (torch.int8, np.int8),
    "INT16": (torch.int16, np.int16),
    "INT32": (torch.int32, np.int32),
    "INT64": (torch.int64, np.int64),
    "FP16": (torch.float16, np.float16),
    "BF16": (torch.bfloat16, None),
    "FP32": (torch.float32, np.float32),
    "FP64": (torch.float64, np.float64),
}
TORCH_DATATYPE = {torch_dtype: name for name, (torch_dtype, _) in DATATYPES.items()}
ITEMSIZE = {name: torch.empty(0, dtype=torch_dtype).element_size() for name, (torch_dtype, _) in DATATYPES.items()}
_JSON_KINDS = {"BOOL": "b", "UINT8": "iu", "INT8": "iu", "INT16": "iu", "INT32": "iu", "INT64": "iu"}
_KIND_NAMES = {"b": "true/false", "i": "integers", "u": "integers", "f": "non-integer numbers", "U": "strings"}
_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def _overflow_at(dtype: torch.dtype) -> float:
    """The least magnitude a float `dtype` rounds to an infinity: its largest value and half a step (a tie rounds to
    the even neighbour, the infinity). Less than it, a value rounds to a finite one (or underflows to 0: fine)."""
    info = torch.finfo(dtype)
    return info.max + info.eps * 2.0 ** (math.frexp(info.max)[1] - 2)


_FLOAT_RANGES = {name: (_overflow_at(DATATYPES[name][0]), float(torch.finfo(DATATYPES[name][0]).max))
                 for name in ("FP16", "FP32")}
_EMPTY: dict[str, Any] = {}
HEADER_LENGTH = "Inference-Header-Content-Length"


class ProtocolError(ValueError):
    """A request the server cannot serve; `status` is the HTTP status to answer with (4xx)."""

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]
    """Per example: the batch dimension is not included."""


@dataclass(frozen=True)
class Signature:
    """What the served model takes and returns, and how many examples one request may carry."""

    input: TensorSpec
    output: TensorSpec
    max_batch_size: int

    def metadata(self, name: str, versions: list[str], platform: str = "pytorch") -> dict[str, Any]:
        """`GET /v2/models/{name}`: shapes with -1 for the batch dimension."""
        return {
            "name": name, "versions": versions, "platform": platform,
            "inputs": [_tensor_metadata(self.input)], "outputs": [_tensor_metadata(self.output)],
        }


def _tensor_metadata(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": [-1, *spec.shape]}


@dataclass
class InferRequest:
    """A decoded, validated inference request."""

    x: np.ndarray | torch.Tensor
    """A numpy array (a tensor for BF16, which numpy lacks): no torch call on the event loop's thread."""
    id: str | None
    binary_output: bool
    timeout_us: int | None


def decode_request(body: bytes, header_length: str | None, signature: Signature) -> InferRequest:
    """Decode and validate an inference request body (JSON, or a JSON header followed by binary tensors when
    `header_length`, the Inference-Header-Content-Length header, is given)."""
    if header_length is None:
        header, binary = body, b""
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise ProtocolError(f"{HEADER_LENGTH}: {header_length!r} is not a byte count") from None
        if not 0 < length <= len(body):
            raise ProtocolError(f"{HEADER_LENGTH}: {length} is outside the body's {len(body)} bytes")
        header, binary = body[:length], body[length:]
    if not header:
        raise ProtocolError("empty request body: expected a JSON inference request with an 'inputs' list")
    try:
        request = orjson.loads(header)
    except orjson.JSONDecodeError as error:
        raise ProtocolError(f"malformed JSON in the request: {error}") from None
    if type(request) is not dict:
        raise ProtocolError(f"the request must be a JSON object with an 'inputs' list; got {_json_type(request)}")
    inputs = request.get("inputs")
    if type(inputs) is not list or len(inputs) != 1 or type(inputs[0]) is not dict \
            or inputs[0].get("name") != signature.input.name:
        _explain_inputs(inputs, signature.input.name)
    parameters = request.get("parameters")
    parameters = _EMPTY if parameters is None else _object(parameters, "parameters")
    x = _decode_tensor(inputs[0], binary, signature)
    binary_output = _binary_output(request, parameters, signature)
    timeout = parameters.get("timeout")
    if timeout is not None and (type(timeout) is not int or timeout < 0):
        raise ProtocolError(f"parameters.timeout must be a non-negative integer (microseconds); got {timeout!r}")
    request_id = request.get("id")
    if request_id is not None and type(request_id) is not str:
        raise ProtocolError(f"id must be a string; got {_json_type(request_id)}")
    return InferRequest(x, request_id, binary_output, timeout or None)


def _explain_inputs(inputs: Any, expected: str) -> None:
    """Raise the ProtocolError that says what is wrong with a request's inputs (not exactly one, named right)."""
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError("the request needs a non-empty 'inputs' list")
    for index, item in enumerate(inputs):
        if not isinstance(item, dict):
            raise ProtocolError(f"inputs[{index}] must be an object with name, shape, datatype and data")
        if item.get("name") != expected:
            raise ProtocolError(f"unknown input {item.get('name')!r}: the model's only input is {expected!r}")
    raise ProtocolError(f"input {expected!r} is given {len(inputs)} times")


def _decode_tensor(item: dict[str, Any], binary: bytes, signature: Signature) -> np.ndarray | torch.Tensor:
    where = f"input {signature.input.name!r}"
    datatype, shape = item.get("datatype"), item.get("shape")
    count = check_tensor(datatype, shape, signature, where)
    torch_dtype, numpy_dtype = DATATYPES[datatype]
    parameters = item.get("parameters")
    size = None if parameters is None else _object(parameters, f"{where} parameters").get("binary_data_size")
    if size is not None:
        if "data" in item:
            raise ProtocolError(f"{where}: give either data or parameters.binary_data_size, not both")
        return _binary_tensor(size, binary, shape, count, datatype, where)
    if binary:
        raise ProtocolError(f"the body has {len(binary)} bytes after the JSON header but no input has "
                            "parameters.binary_data_size")
    if "data" not in item:
        raise ProtocolError(f"{where}: no data (give data, or binary data with parameters.binary_data_size)")
    return listed_tensor(item["data"], shape, count, datatype, torch_dtype, numpy_dtype, where)


def check_tensor(datatype: Any, shape: Any, signature: Signature, where: str) -> int:
    """Check an input tensor's datatype and shape (batch first) against the model's; its number of elements."""
    spec = signature.input
    if datatype != spec.datatype:
        raise ProtocolError(f"{where}: datatype {datatype!r} does not match the model's {spec.datatype}")
    if type(shape) is not list:
        raise ProtocolError(f"{where}: shape must be a list of non-negative integers; got {shape!r}")
    for dimension in shape:  # a loop, not all() over a generator: this runs on the event loop for every request
        if type(dimension) is not int or dimension < 0:
            raise ProtocolError(f"{where}: shape must be a list of non-negative integers; got {shape!r}")
    if len(shape) != len(spec.shape) + 1 or tuple(shape[1:]) != spec.shape:
        wanted = [-1, *spec.shape]
        raise ProtocolError(f"{where}: shape {shape} does not match the model's {wanted} "
                            "(the first dimension is the batch)")
    if not 1 <= shape[0] <= signature.max_batch_size:
        raise ProtocolError(f"{where}: batch size {shape[0]} is outside 1..{signature.max_batch_size} "
                            "(the model's max_batch_size)")
    return math.prod(shape)


def _binary_tensor(size: Any, binary: bytes, shape: list[int], count: int, datatype: str,
                   where: str) -> np.ndarray | torch.Tensor:
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ProtocolError(f"{where}: binary_data_size must be a non-negative integer; got {size!r}")
    itemsize = ITEMSIZE[datatype]
    if size != count * itemsize:
        raise ProtocolError(f"{where}: binary_data_size {size} does not fit shape {shape} of "
                            f"{datatype} ({count * itemsize} bytes)")
    if size != len(binary):
        raise ProtocolError(f"{where}: binary_data_size {size} does not match the {len(binary)} bytes after the "
                            "JSON header")
    return raw_tensor(binary, datatype, shape)


def raw_tensor(binary: bytes, datatype: str, shape: list[int]) -> np.ndarray | torch.Tensor:
    """A tensor of `shape` over `binary` (its exact size, checked by the caller), little-endian, row-major."""
    torch_dtype, numpy_dtype = DATATYPES[datatype]
    if numpy_dtype is None:  # BF16
        return torch.frombuffer(bytearray(binary), dtype=torch_dtype).reshape(shape)
    # Read-only view of the request body; ParallelInference copies it into the batch on its worker thread.
    return np.frombuffer(binary, dtype=numpy_dtype).reshape(shape)


def listed_tensor(data: Any, shape: list[int], count: int, datatype: str, torch_dtype: torch.dtype, numpy_dtype: Any,
                 where: str) -> np.ndarray | torch.Tensor:
    if not isinstance(data, list):
        raise ProtocolError(f"{where}: data must be a list of numbers; got {_json_type(data)}")
    try:
        array = np.asarray(data)
    except ValueError:
        raise ProtocolError(f"{where}: data is not a regular nested list of numbers") from None
    kinds = _JSON_KINDS.get(datatype, "iuf")
    if array.size != count:
        raise ProtocolError(f"{where}: data holds {array.size} values; shape {shape} needs {count}")
    if array.dtype.kind not in kinds:
        wanted = {"b": "true/false", "iu": "integers"}.get(kinds, "numbers")
        found = _KIND_NAMES.get(array.dtype.kind, "values of mixed types")
        raise ProtocolError(f"{where}: {datatype} data must be {wanted}; found {found}")
    if kinds == "iu" and array.size:
        info = np.iinfo(numpy_dtype)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            raise ProtocolError(f"{where}: {datatype} data out of range ({info.min}..{info.max}): found {low}..{high}")
    elif datatype in _FLOAT_RANGES and array.size:
        overflow, largest = _FLOAT_RANGES[datatype]
        low, high = array.min(), array.max()
        if high >= overflow or low <= -overflow:
            found = high if high >= overflow else low
            raise ProtocolError(f"{where}: {datatype} data out of range: {float(found)!r} is beyond the largest "
                                f"{datatype} value, \u00b1{largest:.8g} (send values within it)")
    if numpy_dtype is None:  # BF16: no numpy type; go through float32
        return torch.from_numpy(array.astype(np.float32)).to(torch_dtype).reshape(shape)
    return array.astype(numpy_dtype, copy=False).reshape(shape)  # np.asarray made it: already contiguous


def _binary_output(request: dict[str, Any], parameters: dict[str, Any], signature: Signature) -> bool:
    binary = parameters.get("binary_data_output", False)
    if not isinstance(binary, bool):
        raise ProtocolError(f"parameters.binary_data_output must be true or false; got {binary!r}")
    outputs = request.get("outputs")
    if outputs is None:
        return binary
    if not isinstance(outputs, list):
        raise ProtocolError(f"outputs must be a list; got {_json_type(outputs)}")
    for index, item in enumerate(outputs):
        if not isinstance(item, dict):
            raise ProtocolError(f"outputs[{index}] must be an object with a name")
        if item.get("name") != signature.output.name:
            raise ProtocolError(f"unknown output {item.get('name')!r}: the model's only output is "
                                f"{signature.output.name!r}")
        output_parameters = _object(item.get("parameters"), f"outputs[{index}].parameters")
        if output_parameters.get("classification"):
            raise ProtocolError("the classification extension (class_count) is not supported")
        if "binary_data" in output_parameters:
            binary = output_parameters["binary_data"]
            if not isinstance(binary, bool):
                raise ProtocolError(f"outputs[{index}].parameters.binary_data must be true or false; got {binary!r}")
    return binary


def encode_response(output: np.ndarray | torch.Tensor, request: InferRequest, model: str, version: str,
                    signature: Signature) -> tuple[bytes, str, int | None]:
    """The response to `request` whose output is `output` (its rows of the model's output): the body, its
    content type, and the length of the JSON header when binary tensor data follows it (else None)."""
    spec = signature.output
    head: dict[str, Any] = {"model_name": model, "model_version": version}
    if request.id is not None:
        head["id"] = request.id
    description: dict[str, Any] = {"name": spec.name, "datatype": spec.datatype, "shape": list(output.shape)}
    head["outputs"] = [description]
    if request.binary_output:
        data = tensor_bytes(output)
        description["parameters"] = {"binary_data_size": len(data)}
        header = orjson.dumps(head)
        return header + data, "application/octet-stream", len(header)
    description["data"] = _flat_array(output)
    return orjson.dumps(head, option=_JSON_OPTIONS), "application/json", None


def tensor_bytes(output: np.ndarray | torch.Tensor) -> bytes:
    if isinstance(output, torch.Tensor):  # BF16 (numpy has no such type)
        return output.contiguous().view(torch.int16).numpy().tobytes()
    return output.tobytes()


def _flat_array(output: np.ndarray | torch.Tensor) -> np.ndarray:
    if type(output) is not np.ndarray:  # a BF16 tensor (numpy has no such type)
        output = output.float().numpy()
    return output.ravel()  # row-major and contiguous (copied only where it is not), as orjson needs


def dumps(value: Any) -> bytes:
    return orjson.dumps(value, option=_JSON_OPTIONS)


def _object(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"{where} must be an object; got {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), "null" if value is None else type(value).__name__)
