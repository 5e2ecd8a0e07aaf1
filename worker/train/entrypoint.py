"""`tandem worker train`: one rank, configured only by the worker contract (env vars + the spec file).

`tandem run` starts every rank through this entry point, the operator runs it in pods, and a person can
run it by hand with the same variables.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn

from tandem.api import ParallelTrainingJob
from tandem.contract import (
    GROUP_RESTART_EXIT_CODE,
    PERMANENT_FAILURE_EXIT_CODE,
    GroupMustRestart,
    PermanentFailure,
    WorkerContract,
)
from tandem.worker import checkpoint_owner as owner
from tandem.worker.process_exit import exit_without_teardown
from tandem.worker.train.invalid import InvalidModelOrData, custom_command_problem, report


def load_job(env: WorkerContract) -> ParallelTrainingJob:
    return ParallelTrainingJob.model_validate_json(env.spec_path.read_text())


def run_custom(env: WorkerContract, job: ParallelTrainingJob) -> int:
    """trainingMode custom: replace this process with the user's command; the contract env is already set. The
    stop signals, blocked for Tandem's own trainer, are unblocked first: a blocked mask survives exec, and the
    command would never see the SIGTERM that stops its pod.

    The command's files are its own: no run is recorded for it. Under `tandem run` the launcher holds the checkpoint
    directory's lease while the command runs. Without a launcher (on a cluster), rank 0 refuses a directory another
    run holds, as Tandem's trainer does (an OwnershipError: CheckpointDirectoryTaken), but cannot hold the lease
    while the command runs: exec leaves no thread of Tandem's to renew or remove it, so it lets it go first, and a
    Tandem job started in the directory meanwhile is not refused (give each job its own directory)."""
    from tandem.worker.train.signals import STOP_SIGNALS

    command = [*job.spec.custom.command, *job.spec.custom.args]
    problem = custom_command_problem(command)
    if problem is not None:
        raise InvalidModelOrData(problem)
    if env.is_master and env.run_id is None:
        keeper, _ = _claim_directory(env, job, env.checkpoint_dir or _checkpoint_dir(job), record=False)
        keeper.release()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        os.execvp(command[0], command)
    except OSError as error:
        raise InvalidModelOrData(f"spec.custom.command: cannot start {command[0]!r}: {error.strerror}") from error
    return 127  # only reached if exec returns, which it does not


def main() -> int:
    env = WorkerContract.from_environ()
    job = load_job(env)
    if job.spec.training_mode == "custom":
        return run_custom(env, job)
    return train_rank(env, job)


def train_rank(env: WorkerContract, job: ParallelTrainingJob) -> int:
    """One rank of Tandem's trainer (torch is imported here: a custom command starts without it)."""
    from tandem.worker.train.signals import StopSignals

    stop_signals = StopSignals()  # a stop before training starts exits at once, even in the rendezvous
    from tandem.worker.checkpoint import latest
    from tandem.worker.train.membership import JobFinished
    from tandem.worker.train.preflight import check_fit, load_inputs
    from tandem.worker.train.process_group import join_elastic_group, join_group, shutdown_process_group
    from tandem.worker.train.trainer import RankContext, TakenDuties, seed_everything, train

    spec, trainer = job.spec, job.spec.trainer
    seed_everything(trainer.seed, trainer.deterministic)  # the same initial weights on every rank and every run
    model, train_set, eval_set = load_inputs(trainer)
    if env.is_master:  # before joining: the others wait at the rendezvous, and the job fails with this rank's word
        check_fit(model, train_set, eval_set)
    duties = RankZeroDuties(env, job, env.checkpoint_dir or _checkpoint_dir(job))
    membership = None
    if spec.regroups:
        device, membership = join_elastic_group(env, spec)
        if env.is_master and not membership.joining:
            duties.claim()
        if not membership.joining:  # generation 1 formed: rank 0 has claimed the directory
            membership.start()
    else:
        # Without a launcher holding the checkpoint directory for it (on a cluster, by hand), rank 0 makes it the
        # run's, before joining: the others look for a checkpoint to resume only once it is.
        if env.is_master:
            duties.claim()
        device = join_group(env, gpus=spec.gpus_per_worker, require_gpu=trainer.require_gpu)
    joining = membership is not None and membership.joining
    first = duties.take() if env.is_master and not joining else TakenDuties([], None, env.run_id, None)
    context = RankContext(
        rank=env.rank, world_size=env.world_size, device=device, job=env.job, checkpoint_dir=duties.checkpoint_dir,
        resume_from=None if joining else env.resume_from or (latest(duties.checkpoint_dir) if env.resume_latest
                                                              else None),
        run=first.run, holder=first.holder, sinks=first.sinks, membership=membership,
        regroups_before=env.regroups_before, duties=duties if membership is not None else None,
        share_listeners=[examples_log(env.examples_log, env.rank)] if env.examples_log and membership else [],
    )
    stop_signals.attach(context)
    try:
        train(spec, context, model, train_set, eval_set)
    except JobFinished:
        print("tandem worker: the job's training is over: nothing to join", file=sys.stderr, flush=True)
    except BaseException as error:
        # No orderly leave of the group here: the other ranks must see this one's connections close only when it
        # is gone, so that the first rank to exit is the one that failed first, not a peer that lost it.
        if env.is_master and env.status_file:
            _record_failure(env, error)
        raise
    finally:
        duties.release()
    del model, train_set, eval_set
    shutdown_process_group()
    if membership is not None:
        membership.close()
    return 0


class RankZeroDuties:
    """What rank 0 holds beside training: the status sinks, and the checkpoint directory's lease and run (its own,
    claimed, where no launcher holds the directory for the job: on a cluster, by hand; else the launcher's, read).

    In an elastic job they follow rank 0 of each generation (trainer.take_rank_zero): a rank takes them on when it
    becomes it (slot 0 lost: the lowest slot left), at once since the lease is the same job's, and hands them on when
    it stops being it (slot 0's replacement joined)."""

    def __init__(self, env: WorkerContract, job: ParallelTrainingJob, checkpoint_dir: Path):
        self.env, self.job, self.checkpoint_dir = env, job, checkpoint_dir
        self.keeper: owner.LeaseKeeper | None = None
        self.run = env.run_id
        self.sinks: list = []

    def claim(self) -> None:
        if self.env.run_id is None:
            self.keeper, self.run = _claim_directory(self.env, self.job, self.checkpoint_dir)

    def take(self):
        from tandem.worker.train.reporting import ConsoleSink, StatusFileSink, read_status_file
        from tandem.worker.train.status_sink import KubernetesStatusSink
        from tandem.worker.train.trainer import TakenDuties

        env = self.env
        if self.keeper is None:
            self.claim()
        self.sinks = [StatusFileSink(env.status_file)] if env.status_file else [ConsoleSink(env.job)]
        if env.namespace:  # on a cluster: the job's status subresource too
            self.sinks.append(KubernetesStatusSink(env.job, env.namespace))
        # Rank 0 writes under that lease (its own, or the launcher's it finds): once another holds it, no checkpoint.
        holder = self.keeper.lease if self.keeper is not None else owner.read_lease(self.checkpoint_dir)
        previous = read_status_file(env.status_file) if env.status_file else None
        return TakenDuties(list(self.sinks), holder, self.run, previous)

    def hand_on(self) -> None:
        """Rank 0 no more: the sinks closed (on a thread: the last status is the new rank 0's to send; a sink under
        API faults must not hold the group), the lease released for the new rank 0 to take (it may have already)."""
        sinks, self.sinks = self.sinks, []
        threading.Thread(target=lambda: [sink.close() for sink in sinks], name="tandem-sinks-handed-on",
                         daemon=True).start()
        self.release()

    def release(self) -> None:
        if self.keeper is not None:
            self.keeper.release()
            self.keeper = None


def examples_log(path: Path, slot: int):
    """A listener appending `slot step index index ...` for each step this rank completes (TANDEM_EXAMPLES_LOG)."""
    def append(step: int, indices: list[int]) -> None:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{slot} {step} {' '.join(map(str, indices))}\n")

    return append


def _checkpoint_dir(job: ParallelTrainingJob) -> Path:
    return Path(job.spec.checkpoint.directory)


def _claim_directory(env: WorkerContract, job: ParallelTrainingJob, directory: Path, *, record: bool = True
                     ) -> tuple[owner.LeaseKeeper, str | None]:
    """Rank 0's hold on the checkpoint directory (its lease, renewed until released) and the run it writes as: the
    recorded run when it resumes, else a new one named after the job's uid (checkpoint_owner.plan_directory); without
    `record` (a custom command's files), the lease alone. A lease another job holds is waited for until it goes
    stale; a directory still not the run's to write is an OwnershipError, a permanent failure
    (CheckpointDirectoryTaken): the job fails at once."""
    fresh = owner.RunRecord(run=env.job_uid or owner.new_run_id(), job=env.job, uid=env.job_uid, started=owner.now())
    keeper, plan = owner.claim(
        directory, fresh, resume=env.resume_from is not None or env.resume_latest,
        overwrite=job.spec.checkpoint.overwrite, record=record,
        wait_seconds=owner.LEASE_STALE_SECONDS + owner.LEASE_RENEW_SECONDS,
        waiting=lambda held: print(f"tandem worker: waiting for {directory}, held by {held.describe(owner.now())}",
                                   file=sys.stderr, flush=True))
    if plan is None:
        return keeper, None
    try:
        owner.begin(directory, plan, "tandem worker")
    except BaseException:
        keeper.release()
        raise
    return keeper, plan.run.run


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
    except PermanentFailure as error:  # a model or data that cannot work, a checkpoint directory not the run's
        traceback.print_exc()
        print(report(error), file=sys.stderr, flush=True)  # the output's last lines: the job's message
        code = PERMANENT_FAILURE_EXIT_CODE
    except GroupMustRestart:  # an elastic job's group that cannot regroup: it restarts whole
        traceback.print_exc()
        code = GROUP_RESTART_EXIT_CODE
    except Exception:
        traceback.print_exc()
        code = 1
    exit_without_teardown(code)
