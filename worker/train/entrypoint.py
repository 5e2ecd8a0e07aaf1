"""`tandem worker train`: one rank, configured only by the worker contract (env vars + the spec file).

`tandem run` starts every rank through this entry point, the operator runs it in pods, and a person can
run it by hand with the same variables.
"""

from __future__ import annotations

import os
import signal
import traceback
from pathlib import Path
from typing import NoReturn

from tandem.api import ParallelTrainingJob
from tandem.contract import WorkerContract
from tandem.worker.process_exit import exit_without_teardown


def load_job(env: WorkerContract) -> ParallelTrainingJob:
    return ParallelTrainingJob.model_validate_json(env.spec_path.read_text())


def run_custom(job: ParallelTrainingJob) -> int:
    """trainingMode custom: replace this process with the user's command; the contract env is already set. The
    stop signals, blocked for Tandem's own trainer, are unblocked first: a blocked mask survives exec, and the
    command would never see the SIGTERM that stops its pod."""
    from tandem.worker.train.signals import STOP_SIGNALS

    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    command = [*job.spec.custom.command, *job.spec.custom.args]
    os.execvp(command[0], command)
    return 127  # only reached if exec returns, which it does not


def main() -> int:
    env = WorkerContract.from_environ()
    job = load_job(env)
    if job.spec.training_mode == "custom":
        return run_custom(job)
    return train_rank(env, job)


def train_rank(env: WorkerContract, job: ParallelTrainingJob) -> int:
    """One rank of Tandem's trainer (torch is imported here: a custom command starts without it)."""
    from tandem.worker.train.signals import StopSignals

    stop_signals = StopSignals()  # a stop before training starts exits at once, even in the rendezvous
    from tandem.worker.checkpoint import latest
    from tandem.worker.train.process_group import join_group, shutdown_process_group
    from tandem.worker.train.reporting import ConsoleSink, StatusFileSink
    from tandem.worker.train.status_sink import KubernetesStatusSink
    from tandem.worker.train.trainer import RankContext, seed_everything, train
    from tandem.worker.user_code import build_model, load_dataset

    spec, trainer = job.spec, job.spec.trainer
    device = join_group(env, gpus=spec.gpus_per_worker, require_gpu=trainer.require_gpu)
    seed_everything(trainer.seed, trainer.deterministic)  # the same initial weights on every rank and every run
    model = build_model(trainer.model, trainer.model_args)
    train_set = load_dataset(trainer.data, trainer.data_args)
    eval_set = load_dataset(trainer.eval_data, trainer.data_args) if trainer.eval_data else None
    sinks = []
    if env.is_master:
        sinks = [StatusFileSink(env.status_file)] if env.status_file else [ConsoleSink(env.job)]
        if env.namespace:  # on a cluster: the job's status subresource too
            sinks.append(KubernetesStatusSink(env.job, env.namespace))
    checkpoint_dir = env.checkpoint_dir or _checkpoint_dir(job)
    context = RankContext(
        rank=env.rank, world_size=env.world_size, device=device, job=env.job, checkpoint_dir=checkpoint_dir,
        resume_from=env.resume_from or (latest(checkpoint_dir) if env.resume_latest else None), sinks=sinks,
    )
    stop_signals.attach(context)
    try:
        train(spec, context, model, train_set, eval_set)
    except BaseException as error:
        # No orderly leave of the group here: the other ranks must see this one's connections close only when it
        # is gone, so that the first rank to exit is the one that failed first, not a peer that lost it.
        if env.is_master and env.status_file:
            _record_failure(env, error)
        raise
    del model, train_set, eval_set
    shutdown_process_group()
    return 0


def _checkpoint_dir(job: ParallelTrainingJob) -> Path:
    return Path(job.spec.checkpoint.directory)


def _record_failure(env: WorkerContract, error: BaseException) -> None:
    from tandem.worker.train.reporting import StatusFileSink, read_status_file

    status = read_status_file(env.status_file)
    if status is None:
        return
    status.phase = "Failed"
    status.message = f"rank 0: {type(error).__name__}: {error}"
    StatusFileSink(env.status_file).publish(status)


def cli() -> NoReturn:
    try:
        code = main()
    except Exception:
        traceback.print_exc()
        code = 1
    exit_without_teardown(code)
