"""What a checkpoint holds and how a rank gets it back: the training state, each piece exposing its own state.

Shared by all ranks (written once, by rank 0): the model, the optimizer, the learning-rate schedule's settings
and rate, the gradient scaler, the position (step, data position, skipped-step counts). Each rank's own, gathered
to rank 0: its random number generators (torch, CUDA, Python, NumPy), its mode's state (sharedGradients'
residuals and threshold), and in averaging mode between averagings its own replica. A resumed run continues with
exactly the state it would have had (tests/integration/test_resume.py).

A checkpoint written at another world size (`spec.workers` changed: `--workers`, `kubectl scale`) resumes too,
not bit for bit: the shared state carries over, the epoch goes on from exactly the example its order stopped at,
and what each old rank held alone is reset (`Checkpointer.resume`; rank 0 logs one line saying so).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from tandem.api import ParallelTrainingJobSpec
from tandem.worker import checkpoint, checkpoint_owner
from tandem.worker.train.data import examples_consumed

if TYPE_CHECKING:
    from tandem.worker.train.modes import TrainingMode
    from tandem.worker.train.optim import LearningRateSchedule


@dataclass
class Position:
    """Where training stands: restored from checkpoints, saved into them."""

    step: int = 0
    epoch: int = 0
    batches_done: int = 0
    """Micro-batches of `epoch` consumed from `epoch_start` on, at the world size and batch of the run that saved
    it."""
    bad_steps: int = 0
    consecutive_bad_steps: int = 0
    samples: int = 0
    """Examples trained on since the job began, over all ranks and every world size it ran at (the sampler's padding
    at an epoch's end included)."""
    epoch_start: int = 0
    """The examples of `epoch`'s order consumed at another world size or batch before `batches_done` began counting
    (a resume at another maps what it consumed here: `examples_consumed`); 0 from an epoch's start."""

    def next_epoch(self) -> None:
        self.epoch, self.batches_done, self.epoch_start = self.epoch + 1, 0, 0

    @property
    def epoch_begun(self) -> bool:
        """Whether any example of `epoch` has been consumed."""
        return bool(self.batches_done or self.epoch_start)


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

    def reset_rank_state(self, saved: list[dict[str, Any]], *, seed: int, rank: int) -> list[str]:
        """Resuming `saved`, the per-rank states of a run at another world size, which cannot be mapped onto this
        run's ranks: each rank's generators are seeded as a fresh run seeds them, the mode resets its own state,
        and averaging replicas are dropped (every rank carries on from the checkpoint's model, their average, and
        its optimizer state: the average too with averageOptimizerState, else rank 0's). Returns what was reset,
        for the log line."""
        seed_rank(seed, rank)
        reset = ["each rank's random generators (seeded per rank as a fresh run seeds them)"]
        reset += self.mode.reset_for_world_size(saved, rank)
        if any("replica" in state for state in saved):
            reset.append("each rank's averaging replica (every rank starts from their average)")
        return reset


@dataclass(frozen=True)
class Layout:
    """How a run splits its global batch: `world_size` ranks x `batch_size` examples a micro-batch x `accumulation`
    micro-batches an optimizer step."""

    world_size: int
    batch_size: int
    accumulation: int

    @classmethod
    def of(cls, spec: ParallelTrainingJobSpec, world_size: int) -> Layout:
        trainer = spec.trainer
        return cls(world_size, trainer.batch_size_per_worker, trainer.gradient_accumulation_steps)

    @classmethod
    def of_manifest(cls, manifest: dict[str, Any], default: Layout) -> Layout:
        """The layout a checkpoint was written at (checkpoints from before it was recorded: `default`'s batch)."""
        return cls(int(manifest.get("world_size", default.world_size)),
                   int(manifest.get("batch_size_per_worker", default.batch_size)),
                   int(manifest.get("gradient_accumulation_steps", default.accumulation)))

    def __str__(self) -> str:
        return f"{self.world_size} x {self.batch_size} x {self.accumulation} = " \
               f"{self.world_size * self.batch_size * self.accumulation}"


class Checkpointer:
    """Writes the train state as checkpoints (rank 0 alone writes; every rank takes part) and resumes from one."""

    def __init__(self, spec: ParallelTrainingJobSpec, *, rank: int, world_size: int, job: str, directory: Path,
                 run: str | None = None, holder: checkpoint_owner.Lease | None = None, by_examples: bool = False,
                 wait: Callable[[dist.Work], None] = dist.Work.wait):
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.job = job
        self.directory = directory
        self.run = run
        """The run the checkpoints belong to (the directory's record names it; None: a directory without one)."""
        self.holder = holder
        """The directory's lease the checkpoints are written under (None: none is checked)."""
        self.layout = Layout.of(spec, world_size)
        self.by_examples = by_examples
        """An elastic job's: a resumed position counts the examples of its epoch consumed (Position.epoch_start),
        never micro-batches of a layout."""
        self.wait = wait
        """How the gathering of each rank's state is waited for (an elastic job's: abandoned when a peer stalls)."""
        self.seconds: float | None = None
        """On rank 0, the wall time of the latest save, from its start (the mode's preparation, gathering each rank's
        state) until the file is complete on disk: what a graceful preemption costs (status.preemptionCost)."""
        self.metrics: dict[str, float] = {}
        """What the latest save's evaluation measured, or the resumed checkpoint's (empty without one)."""

    def save(self, state: TrainState, *, input_shape: list[int] | None, final: bool = False,
             evaluate: Callable[[], dict[str, float]] | None = None) -> Path | None:
        """A checkpoint of `state` at its step; the path on rank 0, None on the others. With `final`, the mode
        leaves the model as the checkpoint holds it (averaging: the average). `evaluate` (every rank calls it: the
        evaluation is sharded) measures the model the checkpoint holds; its metrics go into the manifest, where a
        gated InferencePool reads them, and into `self.metrics`."""
        started = time.perf_counter()
        position = state.position
        with state.mode.for_checkpoint(position.step, state.optimizer, final=final) as replica:
            self.metrics = evaluate() if evaluate is not None else {}
            per_rank = gather_to_first(state.rank_state_dict(replica), world_size=self.world_size, wait=self.wait)
            if per_rank is None:
                return None
            trainer = self.spec.trainer
            manifest = checkpoint.build_manifest(
                spec_hash=spec_hash(self.spec), model=trainer.model, model_args=trainer.model_args,
                input_shape=input_shape, input_dtype="FP32", step=position.step, epoch=position.epoch,
                world_size=self.world_size, batch_size_per_worker=self.layout.batch_size,
                gradient_accumulation_steps=self.layout.accumulation, training_mode=self.spec.training_mode,
                job=self.job, run=self.run, metrics=self.metrics,
            )
            contents = {"manifest": manifest, **state.state_dict(), "per_rank": per_rank}
            path = checkpoint.save(self.directory, contents, step=position.step,
                                   keep_last=self.spec.checkpoint.keep_last, run=self.run, holder=self.holder)
            self.seconds = time.perf_counter() - started
            return path

    def resume(self, state: TrainState, source: Path) -> None:
        """Load `source` into `state`; every rank reads the file. Written at this world size and batch, the run
        continues exactly. Otherwise rank 0 logs one line about it (`resize_line`), and:

        - the shared state carries over: model, optimizer, gradient scaler, step (so the learning rate, a function
          of the step) and the count of examples seen;
        - the data position is mapped by examples: the new run deals the current epoch's order from the first
          example the saved run had not consumed (`examples_consumed`): none skipped, none seen twice;
        - at another world size, what each old rank held alone is reset (`TrainState.reset_rank_state`).
        """
        contents = checkpoint.load(source, map_location="cpu")
        state.load_state_dict(contents, source)
        self.metrics = dict(contents["manifest"].get("metrics") or {})
        per_rank = contents.get("per_rank") or []
        saved = Layout.of_manifest(contents["manifest"], default=self.layout)
        reset: list[str] = []
        if saved.world_size == self.world_size:
            if len(per_rank) == self.world_size:
                state.load_rank_state_dict(per_rank[self.rank])
        else:
            reset = state.reset_rank_state(per_rank, seed=self.spec.trainer.seed, rank=self.rank)
        position = state.position
        by_examples = self.by_examples or (saved.world_size, saved.batch_size) != (self.world_size,
                                                                                   self.layout.batch_size)
        if by_examples:
            position.epoch_start += examples_consumed(position.batches_done, world_size=saved.world_size,
                                                      batch_size=saved.batch_size)
            position.batches_done = 0
        if self.rank == 0 and saved != self.layout:
            print(resize_line(source, saved, self.layout, position, reset,
                              consumed=position.epoch_start if by_examples else None), file=sys.stderr, flush=True)

    def regrouped(self, *, rank: int, world_size: int) -> None:
        """An elastic job's group changed: this rank's place in the next one."""
        self.rank, self.world_size, self.layout = rank, world_size, Layout.of(self.spec, world_size)


def resize_line(source: Path, saved: Layout, layout: Layout, position: Position, reset: list[str], *,
                consumed: int | None = None) -> str:
    """The line rank 0 logs when it resumes a checkpoint written at another world size or batch."""
    line = (f"tandem worker: world size and global batch changed (from {saved} to {layout}): resuming "
            f"{source.name} at step {position.step} ({position.samples} examples seen)")
    if consumed is not None:
        line += (f"; epoch {position.epoch + 1} goes on after its first {consumed} examples, from the next one its "
                 "order holds")
    return f"{line}; reset: {', '.join(reset) if reset else 'nothing'}"


def to_bytes(value: Any) -> torch.Tensor:
    """`value` (tensors, plain values) as a checkpoint's bytes, to send to other ranks."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def from_bytes(payload: torch.Tensor) -> Any:
    """What `to_bytes` sent, read back with weights_only: a peer's bytes are never unpickled."""
    return torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=True)


def gather_to_first(value: Any, *, world_size: int, wait: Callable[[dist.Work], None]) -> list[Any] | None:
    """Every rank's `value`, in rank order, on rank 0 (None on the others), through `wait`."""
    payload = to_bytes(value)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    wait(dist.all_gather(sizes, torch.tensor([payload.numel()]), async_op=True))
    longest = max(int(size.item()) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:payload.numel()] = payload
    received = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)] if dist.get_rank() == 0 else None
    wait(dist.gather(padded, received, dst=0, async_op=True))
    if received is None:
        return None
    return [from_bytes(tensor[:int(size.item())]) for tensor, size in zip(received, sizes, strict=True)]


def seed_rank(seed: int, rank: int, step: int = 0) -> None:
    """This rank's generators as a fresh run seeds them: Python's and NumPy's from the job's seed, torch's (dropout
    noise) per rank. `step`: a rank joining an elastic job there, which takes its peers' model but not their
    generators (a copy of one would repeat that peer's dropout noise), nor step 0's (it would replay them)."""
    random.seed(seed + step)
    np.random.seed((seed + step) % 2**32)
    torch.manual_seed(seed + 1_000_003 * rank + 1_000_000_007 * step)


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
