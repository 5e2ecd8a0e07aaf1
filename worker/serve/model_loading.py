"""Where the served model comes from: a trainer checkpoint (read with weights_only), a `module:callable`, or
the checkpoints of a ParallelTrainingJob; and what it takes and returns (its Signature), found by running it
once on an example.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from tandem.api.inference import ModelSource
from tandem.worker import checkpoint as checkpoints
from tandem.worker.serve.protocol import DATATYPES, TORCH_DATATYPE, Signature, TensorSpec
from tandem.worker.user_code import build_model

INPUT_NAME = "input"
OUTPUT_NAME = "output"
CHECKPOINT_DIR_ENV = "TANDEM_CHECKPOINT_DIR"


class ModelLoadError(ValueError):
    """The model cannot be loaded or does not fit what is being served; the message says why."""


@dataclass(frozen=True)
class Origin:
    """Where models are read from: a checkpoint file, a checkpoint directory (its latest checkpoint, followed
    for new ones when `follow`), or a callable."""

    checkpoint: Path | None = None
    directory: Path | None = None
    callable: str | None = None
    args: dict[str, Any] | None = None
    follow: bool = False
    label: str = "checkpoint"
    """For status: `checkpoint`, `callable` or `fromTrainingJob/<name>`."""


@dataclass(frozen=True)
class LoadedModel:
    module: torch.nn.Module
    signature: Signature
    example: torch.Tensor
    """A batch of one example (zeros) of the input's shape and dtype: for warm-up."""
    source: str
    checkpoint: str | None
    loaded_at: datetime


def resolve_origin(model: ModelSource, checkpoint: str | None = None) -> Origin:
    """The origin of `model` (a pool's spec.model); `checkpoint` (tandem serve --checkpoint: a file, or a
    directory whose latest checkpoint is served) overrides it."""
    if checkpoint is not None:
        label = f"fromTrainingJob/{model.from_training_job.name}" if model.from_training_job else "checkpoint"
        return _checkpoint_origin(Path(checkpoint), label, _follows(model))
    if model.checkpoint is not None:
        return _checkpoint_origin(Path(model.checkpoint), "checkpoint", False)
    if model.callable is not None:
        if model.input_shape is None:
            raise ModelLoadError(f"model.inputShape is required with model.callable ({model.callable}): the "
                                 "server validates requests and warms up with it")
        return Origin(callable=model.callable, args=dict(model.args), label="callable")
    job = model.from_training_job
    directory = os.environ.get(CHECKPOINT_DIR_ENV)
    if not directory:
        raise ModelLoadError(
            f"model.fromTrainingJob ({job.name}): pass --checkpoint with the job's checkpoint directory (its "
            f"spec.checkpoint.directory) or one checkpoint file, or set {CHECKPOINT_DIR_ENV}")
    return Origin(directory=Path(directory), follow=job.follow, label=f"fromTrainingJob/{job.name}")


def _follows(model: ModelSource) -> bool:
    return model.from_training_job is not None and model.from_training_job.follow


def _checkpoint_origin(path: Path, label: str, follow: bool) -> Origin:
    if path.is_dir():
        return Origin(directory=path, follow=follow, label=label)
    return Origin(checkpoint=path, label=label)


def current_checkpoint(origin: Origin) -> Path | None:
    """The checkpoint file to serve now (the latest in a directory); None while a directory has none yet."""
    if origin.directory is not None:
        return checkpoints.latest(origin.directory)
    return origin.checkpoint


def load(origin: Origin, model: ModelSource, batch_limit: int, checkpoint: Path | None = None) -> LoadedModel:
    """Build the model (from `checkpoint`, else the origin's current checkpoint or callable), find its signature
    by running it on a batch of two examples. Raises ModelLoadError naming the problem."""
    datatype = model.input_datatype
    if origin.callable is not None and checkpoint is None:
        try:
            module = build_model(origin.callable, origin.args)
        except ValueError as error:
            raise ModelLoadError(str(error)) from error
        shape, path = tuple(model.input_shape), None
    else:
        path = checkpoint or current_checkpoint(origin)
        if path is None:
            raise ModelLoadError(f"no checkpoint in {origin.directory} yet")
        try:
            module, manifest = checkpoints.load_for_inference(path)
        except ValueError as error:  # CheckpointError, or the manifest's model reference failing
            raise ModelLoadError(str(error)) from error
        shape = _checkpoint_shape(path, manifest, model)
        datatype = _checkpoint_datatype(path, manifest, model)
    module.eval()
    example = torch.zeros((1, *shape), dtype=DATATYPES[datatype][0])
    output = _probe(module, example, shape)
    signature = Signature(
        TensorSpec(INPUT_NAME, datatype, shape), TensorSpec(OUTPUT_NAME, output[0], output[1]), batch_limit)
    return LoadedModel(module, signature, example, origin.label, None if path is None else str(path),
                       datetime.now(UTC))


def _checkpoint_shape(path: Path, manifest: dict[str, Any], model: ModelSource) -> tuple[int, ...]:
    saved = manifest.get("input_shape")
    if model.input_shape is not None:
        if saved is not None and list(saved) != list(model.input_shape):
            raise ModelLoadError(f"{path}: model.inputShape {model.input_shape} differs from the checkpoint's input "
                                 f"shape {list(saved)}")
        return tuple(model.input_shape)
    if not saved:
        raise ModelLoadError(f"{path}: the checkpoint's manifest has no input_shape; set model.inputShape")
    return tuple(int(d) for d in saved)


def _checkpoint_datatype(path: Path, manifest: dict[str, Any], model: ModelSource) -> str:
    saved = manifest.get("input_dtype")
    if saved is None:
        return model.input_datatype
    if saved not in DATATYPES:
        raise ModelLoadError(f"{path}: the checkpoint's input_dtype {saved!r} is not one of {', '.join(DATATYPES)}")
    if "input_datatype" in model.model_fields_set and saved != model.input_datatype:
        raise ModelLoadError(f"{path}: model.inputDatatype {model.input_datatype} differs from the checkpoint's "
                             f"input_dtype {saved}")
    return saved


def _probe(module: torch.nn.Module, example: torch.Tensor, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    batch = example.expand(2, *shape).contiguous()
    try:
        with torch.no_grad():
            out = module(batch)
    except Exception as error:
        raise ModelLoadError(f"the model fails on a batch of inputs of shape {[2, *shape]}: "
                             f"{type(error).__name__}: {error}") from error
    if not isinstance(out, torch.Tensor):
        raise ModelLoadError(f"the model returns a {type(out).__name__}; the server serves models returning one tensor")
    if out.dim() == 0 or out.shape[0] != 2:
        raise ModelLoadError(f"the model returns shape {list(out.shape)} for a batch of 2: it needs a row per example")
    if out.dtype not in TORCH_DATATYPE:
        raise ModelLoadError(f"the model returns {out.dtype}, which the protocol cannot carry")
    return TORCH_DATATYPE[out.dtype], tuple(out.shape[1:])


def check_compatible(served: Signature, new: Signature, source: str) -> None:
    """A hot swap keeps the served signature: requests already validated must still fit."""
    if (served.input, served.output) != (new.input, new.output):
        raise ModelLoadError(
            f"{source}: the new model takes {_describe(new.input)} and returns {_describe(new.output)}, but the "
            f"served model takes {_describe(served.input)} and returns {_describe(served.output)}; a hot swap must "
            "keep them (restart the server to change them)")


def _describe(spec: TensorSpec) -> str:
    return f"{spec.datatype} {[-1, *spec.shape]}"
