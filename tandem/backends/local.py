"""`tandem run`: a ParallelTrainingJob on this machine, one process per rank, no cluster.

Each rank is started through the worker entry point with the same contract a pod gets (local_ranks.py starts,
watches and stops one group of them). The launcher renders rank 0's status live, forwards Ctrl-C / SIGTERM as a
request to checkpoint and stop, and never leaves a process behind. It applies the operator's restart policy
(tandem/restart_policy.py), so one manifest behaves the same on one machine and on a cluster:

- a rank that fails (non-zero exit, killed) stops the whole group; after an exponential backoff from
  `--restart-backoff-seconds` the group starts again from the latest complete checkpoint, until `backoffLimit`
  restarts are spent, and then the job fails;
- a model, data or custom command that cannot work fails the job before any rank starts (the pre-flight check,
  worker/train/preflight.py), or at once when a rank finds it so (its exit code and report): InvalidModelOrData,
  no restart; so does a checkpoint directory that is not the run's to write (CheckpointDirectoryTaken, below);
- past `activeDeadlineSeconds` (counted from the first group's start) the ranks get SIGTERM, write a checkpoint
  and stop, or are killed after the grace period; the job fails (DeadlineExceeded).

Before any rank starts, the launcher makes the checkpoint directory this run's (worker/checkpoint_owner.py): it takes
the directory's lease, held until it exits (a second `tandem run` of the directory is refused at once, naming the
holder), and decides the run the ranks write as: the recorded one when resuming, else a new one, refused where
another run's checkpoints are unless `checkpoint.overwrite` moves them aside. A refusal fails the job as a cluster
does (CheckpointDirectoryTaken): `tandem run: Failed: CheckpointDirectoryTaken: ...`, exit code 2.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from tandem.api import ParallelTrainingJob, ParallelTrainingJobStatus
from tandem.api.training import Recovery
from tandem.backends.local_ranks import Launcher
from tandem.backends.run_summary import Ending
from tandem.contract import (
    PERMANENT_FAILURE_EXIT_CODE,
    PermanentFailure,
    PermanentFailureReport,
    permanent_failure_report,
)
from tandem.manifest import ManifestError, load_one
from tandem.restart_policy import after_failure, deadline_exceeded
from tandem.worker import checkpoint, checkpoint_owner
from tandem.worker.local_group import POLL_SECONDS, GroupExit
from tandem.worker.train.invalid import InvalidModelOrData, custom_command_problem, report
from tandem.worker.train.preflight import check_fit, load_inputs
from tandem.worker.train.reporting import ConsoleSink, now

INTERRUPTED_EXIT_CODE = 130  # stopped by Ctrl-C / SIGTERM after a final checkpoint, as shells report SIGINT
DEFAULT_RESTART_BACKOFF_SECONDS = 10.0  # as the operator's --restart-backoff-seconds
GRACE_SECONDS = 30.0  # from SIGTERM to SIGKILL, as a pod's default terminationGracePeriodSeconds


class PreflightError(ValueError):
    """The job cannot start: caught before any rank is launched."""


def preflight(job: ParallelTrainingJob) -> Path | None:
    """Everything that would make every rank fail at once, checked here and reported once: a PreflightError, or an
    InvalidModelOrData for a model, data or custom command that cannot work (tandem/worker/train/preflight.py).
    Returns the checkpoint the ranks resume from (verified to load into the model), if any."""
    spec = job.spec
    checkpoint_dir = Path(spec.checkpoint.directory).resolve()
    resume_from = checkpoint.latest(checkpoint_dir) if spec.checkpoint.resume else None
    if spec.training_mode == "custom":
        problem = custom_command_problem([*spec.custom.command, *spec.custom.args])
        if problem is not None:
            raise InvalidModelOrData(problem)
        return resume_from
    trainer = spec.trainer
    if trainer.require_gpu and not torch.cuda.is_available():
        raise PreflightError(
            "spec.trainer.requireGPU is true but CUDA is not available on this machine; "
            "set requireGPU: false to train on CPU"
        )
    if spec.gpus_per_worker and torch.cuda.is_available() and spec.workers > torch.cuda.device_count():
        raise PreflightError(
            f"spec.workers: {spec.workers} ranks with gpusPerWorker {spec.gpus_per_worker} need a GPU each; this "
            f"machine has {torch.cuda.device_count()}: run with --workers {torch.cuda.device_count()}"
        )
    model, train_set, eval_set = load_inputs(trainer)
    check_fit(model, train_set, eval_set)
    if resume_from is not None:
        try:
            checkpoint.restore_model(model, checkpoint.load(resume_from)["model"], resume_from)
        except checkpoint.CheckpointError as error:
            raise PreflightError(
                f"cannot resume: {error}. Remove it, or start afresh with spec.checkpoint.resume: false and "
                "spec.checkpoint.overwrite: true (which moves the directory's checkpoints aside)"
            ) from error
    return resume_from


def claim_directory(
    job: ParallelTrainingJob,
) -> tuple[checkpoint_owner.LeaseKeeper, checkpoint_owner.DirectoryPlan | None]:
    """The checkpoint directory's lease, held for this `tandem run` (refused at once while another holds it), and how
    the run begins there (refused when it would start afresh among another run's checkpoints): an OwnershipError,
    a permanent failure. A custom command's files are its own: no run is recorded for it."""
    settings = job.spec.checkpoint
    fresh = checkpoint_owner.RunRecord(run=checkpoint_owner.new_run_id(), job=job.metadata.name,
                                       started=checkpoint_owner.now())
    return checkpoint_owner.claim(Path(settings.directory).resolve(), fresh, resume=settings.resume,
                                  overwrite=settings.overwrite, record=job.spec.training_mode != "custom")


class Display:
    """What the person at the terminal sees: rank 0's status (a live bar, or log lines) and the launcher's lines."""

    def __init__(self, title: str):
        self.sink = ConsoleSink(title)

    def show(self, status: ParallelTrainingJobStatus) -> None:
        self.sink.publish(status)

    def say(self, text: str) -> None:
        self.sink.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        self.sink.close()


class LocalJob:
    """The job's groups of ranks, one after another: the first from `resume_from`, each restart from the latest
    checkpoint, until one ends, the restarts allowed are spent, the deadline passes or a stop is asked for."""

    def __init__(self, job: ParallelTrainingJob, *, run_dir: Path, resume_from: Path | None, run: str | None,
                 backoff_seconds: float = DEFAULT_RESTART_BACKOFF_SECONDS, grace_seconds: float = GRACE_SECONDS):
        self.job = job
        self.spec = job.spec
        self.run_dir = run_dir
        self.resume_from = resume_from
        self.run_id = run
        self.backoff_seconds = backoff_seconds
        self.grace_seconds = grace_seconds
        self.checkpoint_dir = Path(self.spec.checkpoint.directory).resolve()
        self.groups: list[Launcher] = []
        self.group: Launcher | None = None
        """The group running now, if any."""
        self.failed: list[tuple[Launcher, GroupExit]] = []
        self.restarts = 0
        self.restart_recovery: Recovery | None = None
        """An elastic job's latest whole-group restart: status.lastRecovery, as the operator writes it on a cluster
        (a regroup's is rank 0's)."""
        self.start_time: datetime | None = None
        self.stop_requested = False

    def request_stop(self, signum=None, frame=None) -> None:  # noqa: ARG002
        self.stop_requested = True
        if self.group is not None:
            self.group.stop()

    def past_deadline(self) -> bool:
        return not self.stop_requested and deadline_exceeded(
            self.start_time, self.spec.active_deadline_seconds, datetime.now(UTC))

    def run(self, display: Display) -> tuple[ParallelTrainingJobStatus, int]:
        """Until the job ends; returns its final status and `tandem run`'s exit code."""
        self.start_time = datetime.now(UTC)
        resume_from = self.resume_from
        while True:
            group = Launcher(self.job, run_dir=self.run_dir / f"group-{len(self.groups)}", resume_from=resume_from,
                             run=self.run_id, grace_seconds=self.grace_seconds,
                             regroups_before=self.status().recoveries.regroups if self.groups else 0)
            self.groups.append(group)
            group.start()
            self.group = group
            if self.restart_recovery is not None and self.restart_recovery.seconds is None:
                self.restart_recovery.seconds = round((datetime.now(UTC) - self.restart_recovery.time).total_seconds(),
                                                      3)
            if self.stop_requested:  # asked while the group was starting
                group.stop()
            ended = group.wait(lambda status: self.show(display, status), display.say, self.past_deadline)
            group.kill_all()  # anything a rank left running
            self.group = None
            if group.stopping_since is not None and not self.stop_requested:
                return self.deadline_exceeded(), 1
            if ended.failed_rank is None or self.stop_requested:
                if ended.failed_rank is not None:
                    self.report_failure(display, group, ended)
                return self.ended(ended)
            self.report_failure(display, group, ended)
            decision = after_failure(restarts_done=self.restarts, backoff_limit=self.spec.backoff_limit,
                                     base_seconds=self.backoff_seconds, cause=ended.cause,
                                     permanent=permanent_failure(group, ended))
            if decision.action == "fail":
                return self.finished("Failed", decision.message), 1
            self.restarts = decision.restarts
            resume_from = checkpoint.latest(self.checkpoint_dir)  # the run's: the directory is its alone
            if self.spec.elastic is not None:
                self.restart_recovery = Recovery(
                    kind="restart", workers=self.spec.workers, time=datetime.now(UTC), message=decision.message,
                    stopped_at_step=self.status().progress.step,
                    resumed_at_step=checkpoint.step_of(resume_from) if resume_from is not None else 0)
            display.say(f"tandem run: Restarting: {decision.message}")
            self.show(display, self.finished("Restarting", decision.message, completed=False))
            self.back_off(decision.delay_seconds)
            if self.stop_requested:
                return self.finished("Suspended", f"stopped on request while restarting after: {ended.cause}; "
                                     "running it again resumes from the latest checkpoint"), INTERRUPTED_EXIT_CODE
            if self.past_deadline():
                return self.deadline_exceeded(), 1

    def report_failure(self, display: Display, group: Launcher, ended: GroupExit) -> None:
        self.failed.append((group, ended))
        display.say(f"tandem run: rank {ended.failed_rank} failed (exit code {ended.code}); its log "
                    f"{group.logs[ended.failed_rank]}:")
        display.say(group.tail(ended.failed_rank))

    def back_off(self, seconds: float) -> None:
        """Wait before the next group; a stop request or the deadline ends the wait at once."""
        until = time.monotonic() + seconds
        while time.monotonic() < until and not self.stop_requested and not self.past_deadline():
            time.sleep(min(POLL_SECONDS, max(0.0, until - time.monotonic())))

    def show(self, display: Display, status: ParallelTrainingJobStatus) -> None:
        status = status.model_copy(deep=True)
        status.restarts, status.start_time = self.restarts, self.start_time.replace(microsecond=0)
        status.recoveries.restarts = self.restarts
        display.show(status)

    def status(self) -> ParallelTrainingJobStatus:
        """The job's status now: rank 0's latest (from whichever group published last) and the launcher's part."""
        published = next((group.status for group in reversed(self.groups) if group.status is not None), None)
        status = ParallelTrainingJobStatus.model_validate(published.model_dump()) if published is not None \
            else ParallelTrainingJobStatus()
        status.restarts, status.start_time = self.restarts, self.start_time.replace(microsecond=0)
        status.recoveries.restarts = self.restarts
        last = status.last_recovery
        if self.restart_recovery is not None and (last is None or last.time is None
                                                  or last.time < self.restart_recovery.time):
            status.last_recovery = self.restart_recovery
        status.workers.total, status.workers.ready = self.spec.workers, 0
        if self.groups:
            status.master.address, status.master.port = "127.0.0.1", self.groups[-1].master_port
        return status

    def finished(self, phase: str, message: str, *, completed: bool = True) -> ParallelTrainingJobStatus:
        status = self.status()
        status.phase, status.message = phase, message
        if completed:
            status.completion_time = status.completion_time or now()
        return ParallelTrainingJobStatus.model_validate(status.model_dump())

    def deadline_exceeded(self) -> ParallelTrainingJobStatus:
        status = self.status()
        message = (f"DeadlineExceeded: the job ran past its activeDeadlineSeconds ({self.spec.active_deadline_seconds}"
                   f" s) and was stopped at step {status.progress.step}")
        if status.checkpoint.latest:
            message += f"; latest checkpoint {status.checkpoint.latest}"
        return self.finished("Failed", message)

    def ended(self, ended: GroupExit) -> tuple[ParallelTrainingJobStatus, int]:
        """The last group ended by itself or on request: rank 0's final status says how."""
        status = self.status()
        if ended.failed_rank is not None:
            status = self.finished("Failed", ended.cause)
        elif self.spec.training_mode == "custom":
            status = self.finished("Succeeded", "all ranks exited 0")
        elif status.phase in ("Running", "Pending"):
            status = self.finished("Suspended" if self.stop_requested else "Failed",
                                   status.message or "ranks exited before reporting a final status")
        return status, {"Succeeded": 0, "Suspended": INTERRUPTED_EXIT_CODE}.get(status.phase, 1)


def permanent_failure(group: Launcher, ended: GroupExit) -> PermanentFailureReport | None:
    """The report of a rank that met a permanent failure (the end of its log), or None."""
    if ended.code != PERMANENT_FAILURE_EXIT_CODE:
        return None
    return permanent_failure_report(group.tail(ended.failed_rank))


def run(path: str, *, workers: int | None = None, status_out: str | None = None, output: str = "summary",
        restart_backoff_seconds: float = DEFAULT_RESTART_BACKOFF_SECONDS) -> int:
    ending = Ending(Path(path), output, status_out)
    try:
        job = load_one(path, ParallelTrainingJob)
        if workers is not None:
            if workers < 1:
                raise PreflightError(f"--workers {workers}: needs at least 1 rank")
            job.spec.workers = workers
        if restart_backoff_seconds < 0:
            raise PreflightError(f"--restart-backoff-seconds {restart_backoff_seconds:g}: must be 0 or more")
        keeper, plan = claim_directory(job)
        try:
            resume_from = preflight(job)
        except BaseException:
            keeper.release()
            raise
    except (ManifestError, PreflightError) as error:
        print(f"tandem run: {error}", file=sys.stderr)
        return 2
    except PermanentFailure as error:  # InvalidModelOrData, or the checkpoint directory's OwnershipError
        return failed_before_start(job, error, ending)
    try:
        return run_claimed(job, plan, keeper.lease.run, resume_from, ending=ending,
                           restart_backoff_seconds=restart_backoff_seconds)
    finally:
        keeper.release()


def run_claimed(job: ParallelTrainingJob, plan: checkpoint_owner.DirectoryPlan | None, run: str,
                resume_from: Path | None, *, ending: Ending, restart_backoff_seconds: float) -> int:
    """`tandem run` once the checkpoint directory's lease is held for `run` (the plan's run, or for a custom command
    the lease's: the ranks are told it, and so that the launcher holds the directory) and the job has passed its
    pre-flight check."""
    if plan is not None:
        checkpoint_owner.begin(Path(job.spec.checkpoint.directory).resolve(), plan, "tandem run")
    run_dir = Path(tempfile.mkdtemp(prefix=f"tandem-{job.metadata.name}-"))
    local_job = LocalJob(job, run_dir=run_dir, resume_from=resume_from, run=run,
                         backoff_seconds=restart_backoff_seconds)
    previous = {sig: signal.signal(sig, local_job.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    display = Display(job.metadata.name)
    try:
        status, code = local_job.run(display)
    finally:
        if local_job.group is not None:
            local_job.group.kill_all()
        display.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    if status.phase != "Succeeded" or status.restarts:
        print(f"tandem run: {status.phase}: {status.message}", file=sys.stderr)
    ending.show(job, status)
    if not local_job.failed:
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def failed_before_start(job: ParallelTrainingJob, error: PermanentFailure, ending: Ending) -> int:
    """The job fails before any rank starts, as it would on a cluster (with the failure's reason, no restart): exit
    code 2, like every mistake found before starting."""
    status = ParallelTrainingJobStatus(phase="Failed", message=report(error), restarts=0, completion_time=now())
    status.workers.total = job.spec.workers
    print(f"tandem run: Failed: {status.message}", file=sys.stderr)
    ending.show(job, status, summary=False)
    return 2
