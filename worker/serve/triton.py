"""Triton's extensions to the Open Inference Protocol, in the shapes Triton's clients expect: the model
configuration (what perf_analyzer reads), the statistics, and the model repository's load request.

Pure functions over dicts and bytes, like protocol.py: the routes call them, tests call them directly.
"""

from __future__ import annotations

from typing import Any

import orjson

from tandem.worker.serve.protocol import ProtocolError, Signature, TensorSpec


def model_config(signature: Signature, name: str, *, instances: int, kind: str, max_queue_delay_us: int,
                 preferred: list[int], queue_limit: int, timeout_us: int) -> dict[str, Any]:
    """`GET /v2/models/{name}/config` in Triton's model configuration shape."""
    return {
        "name": name,
        "platform": "pytorch",
        "backend": "tandem",
        "max_batch_size": signature.max_batch_size,
        "input": [_tensor_config(signature.input)],
        "output": [_tensor_config(signature.output)],
        "dynamic_batching": {
            "preferred_batch_size": preferred,
            "max_queue_delay_microseconds": max_queue_delay_us,
            "default_queue_policy": {
                "max_queue_size": queue_limit,
                "default_timeout_microseconds": timeout_us,
                "timeout_action": "REJECT",
            },
        },
        "instance_group": [{"name": name, "kind": kind, "count": instances}],
        "version_policy": {"latest": {"num_versions": 1}},
    }


def _tensor_config(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "data_type": f"TYPE_{'STRING' if spec.datatype == 'BYTES' else spec.datatype}",
            "format": "FORMAT_NONE", "dims": list(spec.shape)}


def model_stats(name: str, version: str, stats: dict[str, Any]) -> dict[str, Any]:
    """One model's entry of `GET /v2/models/{name}/stats`, from an InferenceStats snapshot."""
    def duration(count: int, ns: int) -> dict[str, int]:
        return {"count": count, "ns": ns}

    compute = stats["compute_count"]
    return {
        "name": name, "version": version, "last_inference": stats["last_inference_ms"],
        "inference_count": stats["inference_count"], "execution_count": stats["execution_count"],
        "inference_stats": {
            "success": duration(stats["success_count"], stats["success_ns"]),
            "fail": duration(stats["fail_count"], stats["fail_ns"]),
            "queue": duration(stats["queue_count"], stats["queue_ns"]),
            "compute_input": duration(compute, stats["compute_input_ns"]),
            "compute_infer": duration(compute, stats["compute_infer_ns"]),
            "compute_output": duration(compute, stats["compute_output_ns"]),
            "cache_hit": duration(0, 0), "cache_miss": duration(0, 0),
            "rejected": duration(stats["rejected_count"], 0),
        },
        "batch_stats": [
            {"batch_size": size, "compute_input": duration(count, input_ns),
             "compute_infer": duration(count, infer_ns), "compute_output": duration(count, output_ns)}
            for size, (count, input_ns, infer_ns, output_ns) in sorted(stats["batches"].items())
        ],
        "memory_usage": [],
    }


def load_request_checkpoint(body: bytes) -> str | None:
    """The checkpoint path of a load request (`POST /v2/repository/models/{name}/load`):
    {"parameters": {"checkpoint": PATH}}, or tritonclient's load_model(name, config='{"checkpoint": PATH}').
    An empty body reloads the current source (None)."""
    if not body.strip():
        return None
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise ProtocolError(f"malformed JSON in the load request: {error}") from None
    parameters = request.get("parameters", {}) if isinstance(request, dict) else None
    if not isinstance(parameters, dict):
        raise ProtocolError('a load request is {"parameters": {"checkpoint": PATH}}')
    return load_parameters_checkpoint(parameters)


def load_parameters_checkpoint(parameters: dict[str, Any]) -> str | None:
    """The checkpoint path a load request's parameters name (`checkpoint`, or `config` as JSON
    {"checkpoint": PATH}); None when they name none (reload the current source)."""
    unknown = sorted(set(parameters) - {"checkpoint", "config"})
    if unknown:
        raise ProtocolError(f"unknown load parameter(s) {', '.join(unknown)}; use checkpoint (a checkpoint path on "
                            "the server)")
    checkpoint = parameters.get("checkpoint")
    if "config" in parameters:
        try:
            config = orjson.loads(parameters["config"])
        except (orjson.JSONDecodeError, TypeError):
            config = None
        if not isinstance(config, dict) or set(config) != {"checkpoint"}:
            raise ProtocolError('parameters.config must be a JSON object {"checkpoint": PATH}')
        checkpoint = config["checkpoint"]
    if checkpoint is not None and (not isinstance(checkpoint, str) or not checkpoint):
        raise ProtocolError(f"parameters.checkpoint must be a path; got {checkpoint!r}")
    return checkpoint
