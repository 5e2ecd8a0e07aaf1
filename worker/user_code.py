"""User code named in a manifest: `module:callable` references and `.npz` data files."""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset


class BadReference(ValueError):
    """A `module:callable` reference that cannot be imported or called."""


def import_reference(ref: str) -> Any:
    """The object `module.path:attribute` names; a ValueError names the reference and the import error."""
    module_name, sep, attribute = ref.partition(":")
    if not sep or not module_name or not attribute:
        raise BadReference(f"{ref!r} is not a `module:callable` reference (e.g. tandem.examples.digits:mlp)")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:  # the user's module may fail in any way while importing
        reason = f"{type(error).__name__}: {error}"
        missing = isinstance(error, ModuleNotFoundError) and error.name == module_name  # itself, not an import of it
        hint = did_you_mean(module_name, sibling_modules(module_name)) if missing else ""
        raise BadReference(f"cannot import module {module_name!r} of {ref!r}: {reason}{hint}") from error
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as error:
            hint = did_you_mean(part, own_names(target))
            raise BadReference(f"{ref!r}: module {module_name!r} has no attribute {attribute!r}{hint}") from error
    return target


def sibling_modules(module_name: str) -> list[str]:
    """The modules of `module_name`'s package (the top-level ones for a top-level name)."""
    package_name, _, _ = module_name.rpartition(".")
    try:
        path = importlib.import_module(package_name).__path__ if package_name else None
    except (ImportError, AttributeError):  # no such package, or a module rather than a package
        return []
    prefix = f"{package_name}." if package_name else ""
    return [prefix + module.name for module in pkgutil.iter_modules(path)]


def own_names(target: Any) -> list[str]:
    """The public names `target` defines: of a module, what it defines itself, not what it imports."""
    names = [name for name in dir(target) if not name.startswith("_")]
    if not isinstance(target, types.ModuleType):
        return names
    return [name for name in names if getattr(getattr(target, name), "__module__", None) == target.__name__]


def did_you_mean(name: str, candidates: list[str]) -> str:
    """`; did you mean 'x'?` with the candidate closest to `name`, or '' when none is close."""
    close = difflib.get_close_matches(name, candidates, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def call_reference(ref: str, kwargs: dict[str, Any] | None = None, *, expect: type | None = None) -> Any:
    """Import `ref`, call it with `kwargs`, and check the result's type."""
    target = import_reference(ref)
    if not callable(target):
        raise BadReference(f"{ref!r} names a {type(target).__name__}, not a callable")
    try:
        result = target(**(kwargs or {}))
    except Exception as error:
        raise BadReference(f"calling {ref!r} failed: {type(error).__name__}: {error}") from error
    if expect is not None and not isinstance(result, expect):
        raise BadReference(f"{ref!r} returned a {type(result).__name__}, expected a {expect.__name__}")
    return result


def build_model(ref: str, kwargs: dict[str, Any] | None = None) -> torch.nn.Module:
    return call_reference(ref, kwargs, expect=torch.nn.Module)


def load_dataset(source: str, kwargs: dict[str, Any] | None = None) -> Dataset:
    """A Dataset from a `module:callable` reference, or from a `.npz` file holding arrays `x` and `y`."""
    if source.endswith(".npz"):
        return _npz_dataset(Path(source))
    dataset = call_reference(source, kwargs)
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise BadReference(f"{source!r} returned a {type(dataset).__name__}, not a map-style Dataset")
    return dataset


def _npz_dataset(path: Path) -> TensorDataset:
    """`.npz` data: `x` (examples first, any numeric dtype; float64 becomes float32), `y` (one label or target per
    example). Integer `y` is kept as int64 class labels."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            missing = {"x", "y"} - set(arrays.files)
            if missing:
                raise BadReference(
                    f"{path}: a data file needs arrays x and y; missing {sorted(missing)} (it holds "
                    f"{sorted(arrays.files)}): save the examples as x and their labels or targets as y, "
                    "numpy.savez(path, x=..., y=...)")
            x, y = arrays["x"], arrays["y"]
    except (OSError, ValueError) as error:
        if isinstance(error, BadReference):
            raise
        raise BadReference(f"{path}: cannot read the data file: {error}") from error
    if len(x) != len(y):
        raise BadReference(f"{path}: x has {len(x)} examples but y has {len(y)}")
    features = torch.from_numpy(x.astype(np.float32) if x.dtype == np.float64 else x)
    labels = torch.from_numpy(y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32))
    return TensorDataset(features, labels)
