"""The check before training: the model reference resolves, the data loads, and one batch of the real data goes
through the model and the loss on the CPU, changing nothing (no gradients, the model's mode and the random
generators restored). Whatever does not fit is an InvalidModelOrData naming the field and the fix (`data has 32
features, the model expects 64`): a restart would fail the same way. `tandem run` runs it before starting any rank,
rank 0 before joining its group, and `tandem validate` where the data is on the machine.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tandem.api import ParallelTrainingJobSpec
from tandem.api.training import TrainerSpec
from tandem.worker.train.invalid import InvalidModelOrData, custom_command_problem
from tandem.worker.train.step import loss_for
from tandem.worker.user_code import BadReference, build_model, load_dataset

CHECK_EXAMPLES = 2
"""Examples in the batch checked: a batch dimension above 1, and little work for a large model's forward on a CPU."""


IGNORED_LABEL = -100
"""cross_entropy's ignore_index: examples (or positions) with this label count for nothing, and are no mistake."""


class Inputs(NamedTuple):
    """What a rank trains: the model and the data its spec names."""

    model: torch.nn.Module
    train_set: Dataset
    eval_set: Dataset | None


@dataclass(frozen=True)
class FirstLayer:
    """What the model's first layer with weights takes: `features` inputs (Linear) or channels (ConvNd, with
    `spatial_dims` dimensions after them), or integer indices (Embedding)."""

    name: str
    kind: str
    features: int
    spatial_dims: int = 0
    takes_indices: bool = False
    weight_dtype: torch.dtype = torch.float32

    def described(self) -> str:
        return f"its first layer, {self.name}: {self.kind}"


def check_job(spec: ParallelTrainingJobSpec) -> None:
    """The job's model, data or custom command as `tandem run` checks them before starting: an InvalidModelOrData if
    they cannot work."""
    if spec.training_mode == "custom":
        problem = custom_command_problem([*spec.custom.command, *spec.custom.args])
        if problem is not None:
            raise InvalidModelOrData(problem)
        return
    check_fit(*load_inputs(spec.trainer))


def data_elsewhere(trainer: TrainerSpec) -> str | None:
    """The first data reference this machine cannot resolve (an .npz file not here, a module not importable here),
    or None when all of them are here."""
    for ref in (trainer.data, trainer.eval_data):
        here = ref is None or (Path(ref).is_file() if ref.endswith(".npz") else _importable(ref.partition(":")[0]))
        if not here:
            return ref
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package missing
        return False
    except Exception:  # here, but a parent package fails as it is imported: the check says how
        return True


def load_inputs(trainer: TrainerSpec) -> Inputs:
    """The model and data `trainer` names, each reference resolved (an InvalidModelOrData names the one that does
    not)."""
    try:
        model = build_model(trainer.model, trainer.model_args)
    except BadReference as error:
        raise InvalidModelOrData(f"spec.trainer.model: {error}") from error
    train_set = loaded_dataset("data", trainer.data, trainer.data_args)
    eval_set = loaded_dataset("evalData", trainer.eval_data, trainer.data_args) if trainer.eval_data else None
    return Inputs(model, train_set, eval_set)


def loaded_dataset(field: str, ref: str, data_args: dict[str, Any]) -> Dataset:
    if ref.endswith(".npz") and not Path(ref).is_file():
        raise InvalidModelOrData(f"spec.trainer.{field}: data file {ref!r} does not exist (in {Path.cwd()})")
    try:
        dataset = load_dataset(ref, data_args)
    except BadReference as error:
        raise InvalidModelOrData(f"spec.trainer.{field}: {error}") from error
    if len(dataset) == 0:
        raise InvalidModelOrData(f"spec.trainer.{field}: {ref!r} holds no examples")
    return dataset


def check_fit(model: torch.nn.Module, train_set: Dataset, eval_set: Dataset | None) -> None:
    """One batch of each dataset through the model and the loss: an InvalidModelOrData if it does not fit. The random
    generators are left as they were (a data loader draws a seed from them)."""
    with torch.random.fork_rng(devices=[]):
        check_batch(model, train_set, "data")
        if eval_set is not None:
            check_batch(model, eval_set, "evalData")


def check_batch(model: torch.nn.Module, dataset: Dataset, field: str) -> None:
    inputs, targets = first_batch(dataset, field)
    outputs = _forward(model, inputs, field)
    problem = target_problem(tuple(outputs.shape[1:]), all_targets(dataset, targets))
    if problem is not None:
        raise InvalidModelOrData(f"spec.trainer.{field}: {problem}")
    try:
        loss_for(outputs, targets)
    except Exception as error:  # whatever torch says, the same on every try
        raise InvalidModelOrData(
            f"spec.trainer.{field}: the loss of the model's outputs {_described(outputs)} against data y "
            f"{_described(targets)} failed: {type(error).__name__}: {_first_line(error)}") from error


def first_batch(dataset: Dataset, field: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The first CHECK_EXAMPLES examples, batched as training batches them: an (inputs, targets) pair of tensors."""
    try:
        batch = next(iter(DataLoader(dataset, batch_size=CHECK_EXAMPLES)))
    except OSError:  # a storage hiccup may pass: a restart tries again
        raise
    except Exception as error:  # the dataset's own code, or examples that cannot be batched: every try alike
        raise InvalidModelOrData(f"spec.trainer.{field}: reading its first {CHECK_EXAMPLES} examples failed: "
                                 f"{type(error).__name__}: {_first_line(error)}") from error
    if not isinstance(batch, list | tuple) or len(batch) != 2 or not all(isinstance(t, torch.Tensor) for t in batch):
        raise InvalidModelOrData(
            f"spec.trainer.{field}: each example must be a pair (x, y) of tensors or numbers; its examples batch into "
            f"{_batch_kind(batch)}")
    return batch[0], batch[1]


def all_targets(dataset: Dataset, batch_targets: torch.Tensor) -> torch.Tensor:
    """Every example's target where the dataset holds them in one tensor (an .npz file's y), else the batch's."""
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors[1]
    return batch_targets


def first_layer(model: torch.nn.Module) -> FirstLayer | None:
    """The model's first Linear, ConvNd or Embedding, in the order its modules were defined; None without one (or
    with a lazy one, whose size the first batch sets)."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin):
            return None
        if isinstance(module, torch.nn.Linear):
            return FirstLayer(name, kind, module.in_features, weight_dtype=module.weight.dtype)
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            return FirstLayer(name, kind, module.in_channels, spatial_dims=len(module.kernel_size),
                              weight_dtype=module.weight.dtype)
        if isinstance(module, torch.nn.Embedding | torch.nn.EmbeddingBag):
            return FirstLayer(name, kind, module.num_embeddings, takes_indices=True)
    return None


def input_problem(example_shape: tuple[int, ...], dtype: torch.dtype, layer: FirstLayer) -> str | None:
    """Why examples of `example_shape` and `dtype` (data x, one example) cannot enter `layer`, with the fix; or None."""
    if layer.takes_indices:
        if dtype.is_floating_point or dtype.is_complex:
            return (f"data x is {_dtype(dtype)}, the model's {layer.described()} takes integer indices: store x as "
                    "integers (x.astype('int64'))")
        return None
    if not (dtype.is_floating_point or dtype.is_complex):
        wanted = _dtype(layer.weight_dtype)
        return (f"data x is {_dtype(dtype)}, the model's weights are {wanted}: store x as {wanted} "
                f"(x.astype('{wanted}'))")
    if layer.spatial_dims == 0:
        return _feature_problem(example_shape, layer)
    return _channel_problem(example_shape, layer)


def _feature_problem(example_shape: tuple[int, ...], layer: FirstLayer) -> str | None:
    features = example_shape[-1] if example_shape else 1
    if features == layer.features:
        return None
    if len(example_shape) > 1 and math.prod(example_shape) == layer.features:
        return (f"data examples have shape {_shape(example_shape)}, the model expects {layer.features} features "
                f"({layer.described()}): flatten each example (x.reshape(len(x), -1)), or start the model with "
                "nn.Flatten()")
    return (f"data has {features} features, the model expects {layer.features} ({layer.described()}): give the model "
            f"{features} inputs (spec.trainer.modelArgs) or data with {layer.features} features")


def _channel_problem(example_shape: tuple[int, ...], layer: FirstLayer) -> str | None:
    dims = layer.spatial_dims + 1
    if len(example_shape) == layer.spatial_dims and layer.features == 1:
        return (f"data examples have shape {_shape(example_shape)}, the model's {layer.described()} takes examples of "
                f"shape (1, {', '.join('…' * layer.spatial_dims)}): add the channel axis (x[:, None])")
    if len(example_shape) != dims:
        return (f"data examples have {len(example_shape)} dimensions {_shape(example_shape)}, the model's "
                f"{layer.described()} takes {dims} (channels first)")
    if example_shape[0] != layer.features:
        return (f"data has {example_shape[0]} channels, the model expects {layer.features} ({layer.described()}): "
                f"give the model {example_shape[0]} input channels (spec.trainer.modelArgs) or data with "
                f"{layer.features} channels first")
    return None


def target_problem(output_shape: tuple[int, ...], targets: torch.Tensor) -> str | None:
    """Why the model's outputs (one example's shape) cannot be scored against `targets` (data y, examples first) by
    the trainer's loss (cross-entropy for integer labels, mean squared error for float targets), with the fix."""
    example_targets = tuple(targets.shape[1:])
    if targets.is_floating_point():
        outputs, values = math.prod(output_shape), math.prod(example_targets)
        if outputs != values:
            return (f"data y has {values} value(s) per example, the model outputs {outputs}: for class labels store y "
                    f"as integers (y.astype('int64')); for regression targets give the model {values} output(s)")
        return None
    if targets.dtype == torch.bool or targets.is_complex():
        return f"data y is {_dtype(targets.dtype)}: store class labels as integers, regression targets as floats"
    if not output_shape or example_targets != output_shape[1:]:
        return (f"data y has shape {_shape(example_targets)} per example, and the model outputs "
                f"{_shape(output_shape)}: with integer class labels it must output one score per class")
    classes = output_shape[0]
    labels = targets[targets != IGNORED_LABEL]
    if labels.numel() == 0:
        return None
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= classes:
        return (f"data y holds class {high if high >= classes else low}, the model outputs {classes} classes (0 to "
                f"{classes - 1}): give the model {max(high + 1, classes)} outputs, or number the classes from 0")
    return None


def _forward(model: torch.nn.Module, inputs: torch.Tensor, field: str) -> torch.Tensor:
    """The model's outputs for `inputs`, leaving the model as it was: evaluation mode (no dropout draw, no BatchNorm
    statistics updated) and no gradients. A forward that fails is explained
    by the model's first layer where that shows the mismatch (only then: a model may apply its layers in another
    order than it defines them)."""
    training = model.training
    try:
        with torch.no_grad():
            model.eval()
            outputs = model(inputs)
    except Exception as error:  # whatever the model's forward raises, it raises on every try
        layer = first_layer(model)
        problem = input_problem(tuple(inputs.shape[1:]), inputs.dtype, layer) if layer is not None else None
        raise InvalidModelOrData(f"spec.trainer.{field}: " + (problem or (
            f"one batch of data x {_described(inputs)} through the model failed: {type(error).__name__}: "
            f"{_first_line(error)}"))) from error
    finally:
        model.train(training)
    if not isinstance(outputs, torch.Tensor):
        raise InvalidModelOrData(f"spec.trainer.model: the model returns a {type(outputs).__name__}; the trainer "
                                 "needs a tensor of outputs (one row per example)")
    return outputs


def _described(tensor: torch.Tensor) -> str:
    return f"({_shape(tuple(tensor.shape))}, {_dtype(tensor.dtype)})"


def _shape(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else ""


def _batch_kind(batch: Any) -> str:
    if isinstance(batch, list | tuple):
        return f"a {type(batch).__name__} of {len(batch)}: {', '.join(type(item).__name__ for item in batch)}"
    return f"a {type(batch).__name__}"
