"""What a checkpoint holds and how a rank gets it back: the training state, each piece exposing its own state.

Shared by all ranks (written once, by rank 0): the model, the optimizer, the learning-rate schedule's settings
and rate, the gradient scaler, the position (step, data position, skipped-step counts). Each rank's own, gathered
to rank 0: its random number generators (torch, CUDA, Python, NumPy), its mode's state (sharedGradients'
residuals and threshold), and in averaging mode between averagings its own replica. A resumed run continues with
exactly the state it would have had (tests/integration/test_resume.py).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from tandem.api import ParallelTrainingJobSpec
from tandem.worker import checkpoint

if TYPE_CHECKING:
    from tandem.worker.train.modes import TrainingMode
    from tandem.worker.train.optim import LearningRateSchedule


@dataclass
class Position:
    """Where training stands: restored from checkpoints, saved into them."""

    step: int = 0
    epoch: int = 0
    batches_done: int = 0
    """Micro-batches of `epoch` already consumed."""
    bad_steps: int = 0
    consecutive_bad_steps: int = 0
    samples: int = 0


@dataclass
class TrainState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    schedule: LearningRateSchedule
    mode: TrainingMode
    position: Position

    def state_dict(self) -> dict[str, Any]:
        """The part all ranks share."""
        return {
            "model": to_host(self.model.state_dict()),
            "optimizer": self.optimizer.state_dict(),
            "lr_schedule": self.schedule.describe(self.position.step),
            "scaler": self.scaler.state_dict(),
            "position": asdict(self.position),
        }

    def load_state_dict(self, state: dict[str, Any], source: Path) -> None:
        checkpoint.restore_model(self.model, state["model"], source)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
        except (KeyError, ValueError, RuntimeError) as error:
            raise checkpoint.CheckpointError(f"{source}: optimizer state does not fit this job ({error})") from error
        self.position = Position(**state["position"])

    def rank_state_dict(self, replica: dict[str, Any] | None) -> dict[str, Any]:
        """This rank's own part, on the host."""
        state = {**random_state(), **to_host(self.mode.state_dict())}
        if replica is not None:
            state["replica"] = replica
        return state

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        load_random_state(state)
        self.mode.load_state_dict(state)
        if "replica" in state:  # averaging, stopped between averagings: this rank's own replica carries on
            self.model.load_state_dict(state["replica"]["model"])
            self.optimizer.load_state_dict(state["replica"]["optimizer"])


class Checkpointer:
    """Writes the train state as checkpoints (rank 0 alone writes; every rank takes part) and resumes from one."""

    def __init__(self, spec: ParallelTrainingJobSpec, *, rank: int, world_size: int, job: str, directory: Path):
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.job = job
        self.directory = directory

    def save(self, state: TrainState, *, input_shape: list[int] | None, final: bool = False) -> Path | None:
        """A checkpoint of `state` at its step; the path on rank 0, None on the others. With `final`, the mode
        leaves the model as the checkpoint holds it (averaging: the average)."""
        position = state.position
        with state.mode.for_checkpoint(position.step, state.optimizer, final=final) as replica:
            per_rank = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(state.rank_state_dict(replica), per_rank, dst=0)
            if self.rank != 0:
                return None
            trainer = self.spec.trainer
            manifest = checkpoint.build_manifest(
                spec_hash=spec_hash(self.spec), model=trainer.model, model_args=trainer.model_args,
                input_shape=input_shape, input_dtype="FP32", step=position.step, epoch=position.epoch,
                world_size=self.world_size, training_mode=self.spec.training_mode, job=self.job,
            )
            contents = {"manifest": manifest, **state.state_dict(), "per_rank": per_rank}
            return checkpoint.save(self.directory, contents, step=position.step,
                                   keep_last=self.spec.checkpoint.keep_last)

    def resume(self, state: TrainState, source: Path) -> None:
        """Load `source` into `state`; every rank reads the file. A checkpoint written at another world size
        gives the shared state only (each rank's generators then stay as this run seeded them)."""
        contents = checkpoint.load(source, map_location="cpu")
        state.load_state_dict(contents, source)
        per_rank = contents.get("per_rank", [])
        if len(per_rank) == self.world_size:
            state.load_rank_state_dict(per_rank[self.rank])


def spec_hash(spec: ParallelTrainingJobSpec) -> str:
    payload = json.dumps(spec.to_dict(), sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


def random_state() -> dict[str, Any]:
    """This process's generators, as plain values and tensors (checkpoints are read with weights_only)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)},
    }
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state()
    return state


def load_random_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])
    if "python_rng" in state:
        random.setstate(_tuples(state["python_rng"]))
    if "numpy_rng" in state:
        numpy = state["numpy_rng"]
        np.random.set_state((numpy["name"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                             numpy["has_gauss"], numpy["cached"]))


def _tuples(value: Any) -> Any:
    """random.setstate wants the tuples it gave (a checkpoint round trip may turn them into lists)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list | tuple) else value


def to_host(value: Any, *, copy: bool = False) -> Any:
    """`value` with every tensor in it on the host; with `copy`, copied even when already there: a snapshot that
    later updates in place leave alone."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=copy)
    if isinstance(value, dict):
        return {k: to_host(v, copy=copy) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_host(v, copy=copy) for v in value)
    return value
