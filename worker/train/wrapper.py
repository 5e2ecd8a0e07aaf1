"""`tandem.ParallelWrapper`: DL4J's ParallelWrapper for single-machine Python users.

    with ParallelWrapper(model, workers=2, mode="sharedGradients", batch_size=32, epochs=10) as wrapper:
        status = wrapper.fit(train_set, eval_data=eval_set)
    # `model` now holds the trained parameters

Ranks are processes (started with `spawn`, so define the model's class in an importable module or
under `if __name__ == "__main__":`), joined in a gloo group on CPU or NCCL with one GPU each, running
the same training loop as `tandem run` and the operator's pods.

Its checkpoint directory is its run's, as `tandem run`'s is (worker/checkpoint_owner.py): each `fit` takes the
directory's lease before any rank starts and releases it when they end (a `tandem run`, or a ParallelWrapper in
another process, is refused while it holds it, and the other way round), and records the wrapper's run there: one
run for the wrapper's life, each `fit` continuing it. A directory holding another run's checkpoints is refused
(OwnershipError), never mixed with them.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.utils.data import Dataset

from tandem.api import ParallelTrainingJobSpec, ParallelTrainingJobStatus
from tandem.contract import WorkerContract
from tandem.worker import checkpoint_owner as owner
from tandem.worker.process_exit import exit_without_teardown
from tandem.worker.train.process_group import free_port, join_group, shutdown_process_group
from tandem.worker.train.reporting import ConsoleSink
from tandem.worker.train.trainer import RankContext, train


def _reference(obj: Any) -> str:
    """The `module:Class` of an object, recorded in checkpoint manifests as where the architecture lives."""
    kind = type(obj)
    return f"{kind.__module__}:{kind.__qualname__}"


JOB = "ParallelWrapper"
"""The job name its ranks, its run record and its lease go by."""


class ParallelWrapper:
    """Data-parallel training of `model` over `workers` local ranks; after `fit`, `model` holds the result.

    Keyword options map onto the ParallelTrainingJob spec: `mode` (allReduce | sharedGradients | averaging),
    `batch_size` (per worker), `epochs`, `max_steps`, `optimizer` ("sgd" | "adam" | "adamw"), `lr`,
    `momentum`, `weight_decay`, `averaging_frequency`, `average_optimizer_state`, `prefetch_buffer`,
    `gpus` (one GPU per worker; default: when CUDA is available), `checkpoint_dir`, `ranks_per_pod` (the spec's
    ranksPerPod: checked against `workers`, and otherwise nothing on one machine, where every rank is local),
    and any other TrainerSpec field by its Python name (e.g. `gradient_clip_norm=1.0`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        workers: int = 2,
        ranks_per_pod: int = 1,
        mode: str = "allReduce",
        batch_size: int = 32,
        epochs: int = 1,
        optimizer: str = "sgd",
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        averaging_frequency: int = 1,
        average_optimizer_state: bool = True,
        gpus: bool | None = None,
        checkpoint_dir: str | Path | None = None,
        show_progress: bool = True,
        **trainer_options: Any,
    ):
        self.model = model
        self.show_progress = show_progress
        self._owned_checkpoint_dir = checkpoint_dir is None
        self.checkpoint_dir = Path(checkpoint_dir or tempfile.mkdtemp(prefix="tandem-wrapper-")).resolve()
        self.run = owner.RunRecord(run=owner.new_run_id(), job=JOB, started=owner.now())
        """The run its checkpoints belong to: every `fit` of this wrapper continues it."""
        use_gpus = torch.cuda.is_available() if gpus is None else gpus
        self.spec_fields = {
            "workers": workers,
            "ranks_per_pod": ranks_per_pod,
            "gpus_per_worker": 1 if use_gpus else 0,
            "training_mode": mode,
            "averaging": {"frequency": averaging_frequency, "average_optimizer_state": average_optimizer_state},
            "checkpoint": {"directory": str(self.checkpoint_dir), "resume": False},
        }
        self.trainer_fields = {
            "model": _reference(model),
            "batch_size_per_worker": batch_size,
            "epochs": epochs,
            "optimizer": {"name": optimizer, "lr": lr, "momentum": momentum, "weight_decay": weight_decay},
            **trainer_options,
        }
        self._closed = False

    def fit(self, data: Dataset, eval_data: Dataset | None = None) -> ParallelTrainingJobStatus:
        """Train on `data` (a map-style Dataset of (input, target)); returns the final status. The checkpoint
        directory's lease is held meanwhile: an OwnershipError, before any rank starts, while another process holds
        it or where another run's checkpoints are."""
        if self._closed:
            raise RuntimeError("this ParallelWrapper is closed")
        spec = ParallelTrainingJobSpec.model_validate({
            **self.spec_fields, "trainer": {**self.trainer_fields, "data": _reference(data)},
        })
        keeper, plan = owner.claim(self.checkpoint_dir, self.run, resume=False, overwrite=False)
        results = Path(tempfile.mkdtemp(prefix="tandem-fit-"))
        try:
            owner.begin(self.checkpoint_dir, plan, JOB)
            mp.start_processes(
                _rank_main,
                args=(spec.model_dump_json(), free_port(), self.model, data, eval_data, results, self.show_progress,
                      plan.run.run, keeper.lease),
                nprocs=spec.workers, join=True, start_method="spawn",
            )
            state = torch.load(results / "model.pt", map_location="cpu", weights_only=True)
            self.model.load_state_dict(state)
            return ParallelTrainingJobStatus.model_validate_json((results / "status.json").read_text())
        finally:
            shutil.rmtree(results, ignore_errors=True)
            keeper.release()

    def close(self) -> None:
        """Release the wrapper; its temporary checkpoint directory (if it made one) is removed."""
        self._closed = True
        if self._owned_checkpoint_dir:
            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)

    def __enter__(self) -> ParallelWrapper:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _rank_main(rank, spec_json, port, model, data, eval_data, results: Path, show_progress: bool, run: str,
               holder: owner.Lease) -> None:
    # torch's spawn pickler hands every rank the same shared-memory tensors: without a copy the ranks would all
    # update one set of parameters. The datasets stay shared (read only, and one copy in memory).
    model = copy.deepcopy(model)
    spec = ParallelTrainingJobSpec.model_validate_json(spec_json)
    env = WorkerContract.local(rank, spec.workers, master_port=port, job=JOB)
    device = join_group(env, gpus=spec.gpus_per_worker, require_gpu=spec.trainer.require_gpu)
    sinks = [ConsoleSink("ParallelWrapper")] if rank == 0 and show_progress else []
    context = RankContext(
        rank=rank, world_size=spec.workers, device=device, job=env.job,
        checkpoint_dir=Path(spec.checkpoint.directory), run=run, holder=holder, sinks=sinks,
    )
    try:
        status = train(spec, context, model, data, eval_data)
        if rank == 0:
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, results / "model.pt")
            (results / "status.json").write_text(json.dumps(status.to_dict()))
    finally:
        del model, data, eval_data
        shutdown_process_group()
    exit_without_teardown(0)
