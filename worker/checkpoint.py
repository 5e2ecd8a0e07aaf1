"""Checkpoints: written atomically by rank 0, read back only with `torch.load(weights_only=True)`.

A checkpoint is one file `step-00000120.pt` in the checkpoint directory holding a dict of tensors and
plain values (no pickled classes):

    format        "tandem-checkpoint/1"
    manifest      tandem/torch/python versions, spec hash, model reference + args, input shape/dtype,
                  step, epoch, world size, training mode, time
    model         the model's state_dict
    ...           whatever else the trainer saves (optimizer, the lr schedule's settings and current rate,
                  RNG states, data position, compression residuals)

The file appears under its final name only once complete (temp file, fsync, rename, fsync of the
directory), so any `step-*.pt` is a finished checkpoint; a damaged one is still refused on load. The directory's
run record (checkpoint_owner.py) lists the files its run wrote: `keepLast` prunes, and `latest` looks, among those
alone.
"""

from __future__ import annotations

import os
import pickle
import platform
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import tandem
from tandem.contract import checkpoint_name
from tandem.worker import checkpoint_owner

FORMAT = "tandem-checkpoint/1"
_NAME = re.compile(r"^step-(\d{8,})\.pt$")
_ZIP_MAGIC = b"PK\x03\x04"  # every torch.save file since torch 1.6


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, truncated, corrupt, or not fitting the model."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / checkpoint_name(step)


def step_of(path: Path) -> int:
    """The step of the checkpoint at `path` (named by `checkpoint_path`)."""
    found = _NAME.match(path.name)
    if found is None:
        raise CheckpointError(f"{path} is not named like a checkpoint (step-NNNNNNNN.pt)")
    return int(found.group(1))


def build_manifest(**fields: Any) -> dict[str, Any]:
    """The manifest saved with every checkpoint: `fields` plus the versions that wrote it."""
    return {
        "tandem": tandem.__version__,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        **fields,
    }


def save(directory: Path, state: Mapping[str, Any], *, step: int, keep_last: int, run: str | None = None,
         holder: checkpoint_owner.Lease | None = None) -> Path:
    """Write `state` (which must hold `manifest` and `model`) as the checkpoint of `step` of `run`, the directory's
    recorded run (None: a directory without a record), under the lease `holder` (if any: refused once another holds
    the directory's lease); keep the run's newest `keep_last`. Returns the final path, which exists only once the
    file is complete."""
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    temporary = directory / f".{final.name}.{os.getpid()}.tmp"
    _claim_name(directory, final.name, run, holder)
    try:
        with open(temporary, "wb") as file:
            torch.save({"format": FORMAT, **state}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_directory(directory)
    pruned = checkpoint_owner.run_files(directory)[:-keep_last]
    for old in pruned:
        (directory / old).unlink(missing_ok=True)
    if run is not None:
        checkpoint_owner.forget(directory, pruned)
    return final


def _claim_name(directory: Path, name: str, run: str | None, holder: checkpoint_owner.Lease | None) -> None:
    """Count `name` as `run`'s before it is written (while `holder`, if any, holds the directory's lease); without a
    run, only in a directory no run has recorded."""
    try:
        if run is not None:
            checkpoint_owner.record_written(directory, name, run, holder)
        elif (recorded := checkpoint_owner.read_run(directory)) is not None:
            raise checkpoint_owner.OwnershipError(
                f"{directory} holds the checkpoints of run {recorded.run} (job {recorded.job}): not writing {name} "
                "there; use another checkpoint directory")
    except checkpoint_owner.OwnershipError as error:
        raise CheckpointError(str(error)) from error


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [path for _, path in sorted(found)]


def latest(directory: Path) -> Path | None:
    """The latest complete checkpoint of the directory's run (the last it wrote; in a directory without a run
    record, the highest step), None when there is none."""
    checkpoints = checkpoint_owner.run_files(directory) if directory.is_dir() else []
    return directory / checkpoints[-1] if checkpoints else None


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint safely (weights_only); CheckpointError says what is wrong with it. Only a zip archive, as
    torch.save writes, reaches torch.load: any other file would go to torch's legacy format reader, whose
    weights-only unpickler fails on arbitrary bytes in arbitrary ways."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with open(path, "rb") as file:
            magic = file.read(len(_ZIP_MAGIC))
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({error.strerror or error})") from error
    if magic != _ZIP_MAGIC:
        raise CheckpointError(f"{path}: not a Tandem checkpoint: not a zip archive as torch.save writes (another kind "
                              "of file, or a truncated or corrupt checkpoint)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        detail = (str(error).split("WeightsUnpickler error:")[-1].strip().splitlines() or ["?"])[0]
        detail = detail.split(" Please use `torch.serialization")[0]  # its advice to trust the file: not ours
        if "Unsupported global" in detail:
            raise CheckpointError(
                f"{path}: refused: it holds pickled objects, not only tensors and plain values, and checkpoints are "
                f"only read with weights_only ({detail})"
            ) from error
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint ({detail})") from error
    except Exception as error:  # torch's zip reader and unpickler fail on damaged files in many ways
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint ({type(error).__name__}: {error})") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path}: not a Tandem checkpoint (format {found!r}, expected {FORMAT!r})")
    for key in ("manifest", "model"):
        if key not in state:
            raise CheckpointError(f"{path}: incomplete checkpoint: no {key!r} entry")
    if not isinstance(state["manifest"], dict):
        raise CheckpointError(f"{path}: damaged checkpoint: its manifest is a {type(state['manifest']).__name__}, "
                              "not a mapping")
    if not isinstance(state["model"], dict):
        raise CheckpointError(f"{path}: damaged checkpoint: its 'model' entry is a {type(state['model']).__name__}, "
                              "not a state_dict")
    return state


def restore_model(model: torch.nn.Module, state_dict: Mapping[str, Any], source: str | Path) -> None:
    """Load weights into `model`, or a CheckpointError listing what does not fit."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    mismatched = [
        f"{name} {tuple(state_dict[name].shape)} vs model {tuple(own[name].shape)}"
        for name in sorted(set(own) & set(state_dict))
        if isinstance(state_dict[name], torch.Tensor) and state_dict[name].shape != own[name].shape
    ]
    if missing or unexpected or mismatched:
        problems = []
        if missing:
            problems.append(f"missing {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
        if unexpected:
            problems.append(f"unexpected {', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else ""))
        if mismatched:
            problems.append(f"shape mismatch {'; '.join(mismatched[:5])}")
        raise CheckpointError(f"{source}: checkpoint does not fit the model: {' | '.join(problems)}")
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as error:
        raise CheckpointError(f"{source}: checkpoint does not fit the model: {error}") from error


def load_for_inference(
    path: str | Path, reference_required: str | None = None,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The checkpoint's model, rebuilt from its manifest's reference, weights loaded, in eval mode. With
    `reference_required`, a manifest naming another module:callable is refused before anything is imported: the
    reference is code the server would run, and a file someone may place under a server's model repository must
    not choose it."""
    from tandem.worker.user_code import build_model

    state = load(path)
    manifest = state["manifest"]
    reference, args = manifest.get("model"), manifest.get("model_args", {})
    if not isinstance(reference, str):
        raise CheckpointError(f"{path}: the manifest names no model reference (module:callable) to rebuild the "
                              "architecture")
    if reference_required is not None and reference != reference_required:
        raise CheckpointError(f"{path}: the checkpoint's model is {reference}, but this server serves "
                              f"{reference_required}: a swap may change the weights and the model's arguments, not "
                              "the code that builds it (start a server for that model instead)")
    if not isinstance(args, dict):
        raise CheckpointError(f"{path}: the manifest's model_args is a {type(args).__name__}, not a mapping")
    try:
        model = build_model(reference, args)
    except ValueError as error:  # BadReference: cannot import or call it
        raise CheckpointError(f"{path}: cannot rebuild the checkpoint's model: {error}") from error
    restore_model(model, state["model"], path)
    return model.eval(), manifest
