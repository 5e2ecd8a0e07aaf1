"""Loading the model to serve: where it is (a ModelLocation: a trainer checkpoint read with weights_only, a
checkpoint directory such as a ParallelTrainingJob's, or a `module:callable`), building it, and what it takes
and returns (its Signature), found by running it once on an example. Synchronous and blocking: the server runs
it on an executor thread (served_model.py).

Also what a load request may read (the pool's spec.modelRepository): nothing unless `load` is on, and then only
checkpoint files under the repository root, after symlinks and `..` are resolved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from tandem import contract
from tandem.api.inference import ModelRepository, ModelSource
from tandem.worker import checkpoint as checkpoints
from tandem.worker.serve.errors import ModelError
from tandem.worker.serve.promotion import recorded_metrics
from tandem.worker.serve.protocol import DATATYPES, TORCH_DATATYPE, Signature, TensorSpec
from tandem.worker.serve.replicas import check_output
from tandem.worker.user_code import build_model

INPUT_NAME = "input"
OUTPUT_NAME = "output"


class ModelLoadError(ValueError):
    """The model cannot be loaded or does not fit what is being served; the message says why."""


class LoadForbidden(PermissionError):
    """A load request the pool's spec.modelRepository does not allow (HTTP 403); the message says why and what to
    change."""


LOADS_DISABLED = "model repository loads are disabled: set spec.modelRepository.load: true in the InferencePool"


@dataclass(frozen=True)
class ModelLocation:
    """Where a server reads its models from (a pool's spec.model, resolved): a checkpoint file, a checkpoint
    directory (its latest checkpoint, followed for new ones when `follow`), or a callable."""

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
    reference: str
    """The module:callable that built it (the callable, or the checkpoint manifest's): a swap must keep it."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The metrics its job recorded in the checkpoint's manifest (none for a callable or an older checkpoint)."""

    @property
    def loaded_from(self) -> str:
        """Its checkpoint's path, else its source (`callable`, ...): for logs and the repository index."""
        return self.checkpoint or self.source

    def parameters(self) -> dict[str, str | float | None]:
        """The model metadata's `parameters`: what each replica serves, for the operator's status.model."""
        return {"checkpoint": self.checkpoint, "source": self.source,
                "loaded_at": self.loaded_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                **{f"{contract.SERVED_METRIC_PARAMETER}{name}": value for name, value in self.metrics.items()}}


def locate(model: ModelSource, checkpoint: str | None = None) -> ModelLocation:
    """Where to read `model` (a pool's spec.model) from; `checkpoint` (tandem serve --checkpoint: a file, or a
    directory whose latest checkpoint is served) overrides it. Raises ModelLoadError naming what is missing."""
    job = model.from_training_job
    if checkpoint is not None:
        label = f"fromTrainingJob/{job.name}" if job else "checkpoint"
        return _checkpoint_location(Path(checkpoint), label, _follows(model), job.checkpoint if job else None)
    if model.checkpoint is not None:
        return _checkpoint_location(Path(model.checkpoint), "checkpoint", False)
    if model.callable is not None:
        if model.input_shape is None:
            raise ModelLoadError(f"model.inputShape is required with model.callable ({model.callable}): the "
                                 "server validates requests and warms up with it")
        return ModelLocation(callable=model.callable, args=dict(model.args), label="callable")
    directory = os.environ.get(contract.CHECKPOINT_DIR)
    if not directory:
        raise ModelLoadError(
            f"model.fromTrainingJob ({job.name}): pass --checkpoint with the job's checkpoint directory (its "
            f"spec.checkpoint.directory) or one checkpoint file, or set {contract.CHECKPOINT_DIR}")
    return _checkpoint_location(Path(directory), f"fromTrainingJob/{job.name}", job.follow, job.checkpoint)


def _follows(model: ModelSource) -> bool:
    job = model.from_training_job
    return job is not None and job.follow and job.checkpoint is None


def _checkpoint_location(path: Path, label: str, follow: bool, pinned: str | None = None) -> ModelLocation:
    """`pinned` (fromTrainingJob.checkpoint): the checkpoint of that name in a directory, loaded and kept."""
    if path.is_dir() and pinned is not None:
        pinned_path = path / pinned
        if not pinned_path.is_file():
            present = ", ".join(p.name for p in checkpoints.list_checkpoints(path)) or "none"
            raise ModelLoadError(f"model.fromTrainingJob.checkpoint {pinned}: no such checkpoint in {path} (there: "
                                 f"{present}); name one the job has kept (its status.checkpoint.history)")
        return ModelLocation(checkpoint=pinned_path, label=label)
    if path.is_dir():
        return ModelLocation(directory=path, follow=follow and pinned is None, label=label)
    return ModelLocation(checkpoint=path, label=label)


def checkpoint_to_serve(location: ModelLocation) -> Path | None:
    """The checkpoint file `location` stands for now: its file, or the latest in its directory (None while the
    directory has none yet)."""
    if location.directory is not None:
        return checkpoints.latest(location.directory)
    return location.checkpoint


def repository_root(repository: ModelRepository, location: ModelLocation) -> Path | None:
    """The directory load requests may read checkpoints under: spec.modelRepository.root, else the directory the
    server serves from (a followed checkpoint directory, or the served checkpoint file's directory); None for a
    callable with no root set."""
    if repository.root is not None:
        return Path(repository.root)
    if location.directory is not None:
        return location.directory
    if location.checkpoint is not None:
        return location.checkpoint.parent
    return None


def repository_checkpoint(requested: str, root: Path | None) -> Path:
    """The checkpoint file a load request names, resolved (symlinks and `..`), which must lie under `root`; a
    directory names its latest checkpoint. LoadForbidden outside the root (or with no root), ModelLoadError for a
    directory with no checkpoint."""
    if root is None:
        raise LoadForbidden("this server serves a callable and has no model repository root, so no checkpoint may "
                            "be loaded: set spec.modelRepository.root in the InferencePool to the directory whose "
                            "checkpoints load requests may name")
    real_root = Path(os.path.realpath(root))
    path = _under_root(requested, root, real_root)
    if path.is_dir():
        path = _under_root(str(latest_or_load_error(path)), root, real_root)
    return path


def _under_root(requested: str, root: Path, real_root: Path) -> Path:
    real = Path(os.path.realpath(requested))
    if not real.is_relative_to(real_root):
        resolved = "" if str(real) == requested else f" (it resolves to {real})"
        raise LoadForbidden(f"{requested}{resolved} is outside the model repository root {root}")
    return real


def latest_or_load_error(directory: Path) -> Path:
    """The latest checkpoint in `directory` where a load names a directory; ModelLoadError when it has none."""
    latest = checkpoints.latest(directory)
    if latest is None:
        raise ModelLoadError(f"{directory}: no checkpoint in this directory")
    return latest


def load(location: ModelLocation, model: ModelSource, batch_limit: int,
         checkpoint: Path | None = None, reference_required: str | None = None) -> LoadedModel:
    """Build the model (from `checkpoint`, else the location's current checkpoint or callable), find its signature
    by running it on a batch of two examples. With `reference_required` (a swap: the served model's), a checkpoint
    whose model is built by other code is refused unread. Raises ModelLoadError naming the problem."""
    datatype = model.input_datatype
    if location.callable is not None and checkpoint is None:
        try:
            module = build_model(location.callable, location.args)
        except ValueError as error:
            raise ModelLoadError(str(error)) from error
        shape, path = tuple(model.input_shape), None
    else:
        path = checkpoint or checkpoint_to_serve(location)
        if path is None:
            raise ModelLoadError(f"no checkpoint in {location.directory} yet")
        try:
            module, manifest = checkpoints.load_for_inference(path, reference_required)
            shape = _checkpoint_shape(path, manifest, model)
            datatype = _checkpoint_datatype(path, manifest, model)
        except ValueError as error:  # CheckpointError or ModelLoadError: they name the file and the problem
            raise ModelLoadError(str(error)) from error
        except Exception as error:  # whatever else a damaged checkpoint makes fail: still the file's problem
            raise ModelLoadError(f"{path}: cannot load this checkpoint: {type(error).__name__}: {error}") from error
    module.eval()
    example = torch.zeros((1, *shape), dtype=DATATYPES[datatype][0])
    output = _probe(module, example, shape)
    signature = Signature(
        TensorSpec(INPUT_NAME, datatype, shape), TensorSpec(OUTPUT_NAME, output[0], output[1]), batch_limit)
    reference = location.callable if path is None else manifest["model"]
    return LoadedModel(module, signature, example, location.label, None if path is None else str(path),
                       datetime.now(UTC), reference, {} if path is None else recorded_metrics(manifest))


def checkpoint_metrics(path: Path) -> dict[str, float]:
    """The metrics recorded in a checkpoint's manifest, without building its model; none for a checkpoint that
    cannot be read (the gate then skips it: it has no metric to beat the served one with)."""
    try:
        return recorded_metrics(checkpoints.load(path)["manifest"])
    except checkpoints.CheckpointError:
        return {}


def _checkpoint_shape(path: Path, manifest: dict[str, Any], model: ModelSource) -> tuple[int, ...]:
    saved = manifest.get("input_shape")
    if model.input_shape is not None:
        if saved is not None and list(saved) != list(model.input_shape):
            raise ModelLoadError(f"{path}: model.inputShape {model.input_shape} differs from the checkpoint's input "
                                 f"shape {list(saved)}")
        return tuple(model.input_shape)
    if not saved:
        raise ModelLoadError(f"{path}: the checkpoint's manifest has no input_shape; set model.inputShape")
    if not isinstance(saved, list | tuple) or not all(isinstance(d, int) and d > 0 for d in saved):
        raise ModelLoadError(f"{path}: the checkpoint's input_shape {saved!r} is not a list of positive sizes")
    return tuple(saved)


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
    try:
        check_output(out, 2)
    except ModelError as error:
        raise ModelLoadError(str(error)) from None
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
