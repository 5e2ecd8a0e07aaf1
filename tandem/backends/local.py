"""`tandem run`: a ParallelTrainingJob on this machine, one process per rank, no cluster.

Each rank is started through the worker entry point with the same contract a pod gets. The launcher
renders rank 0's status live, stops every rank when one fails, forwards Ctrl-C / SIGTERM as a request
to checkpoint and stop, and never leaves a process behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.api import ParallelTrainingJob, ParallelTrainingJobStatus
from tandem.contract import WorkerContract
from tandem.manifest import ManifestError, load_one
from tandem.worker import checkpoint
from tandem.worker.train.process_group import free_port
from tandem.worker.train.reporting import ConsoleSink, now, read_status_file
from tandem.worker.user_code import BadReference, build_model, import_reference

POLL_SECONDS = 0.2
INTERRUPTED_EXIT_CODE = 130  # stopped by Ctrl-C / SIGTERM after a final checkpoint, as shells report SIGINT
LOG_TAIL_LINES = 30
_PR_SET_PDEATHSIG = 1


class PreflightError(ValueError):
    """The job cannot start: caught before any rank is launched."""


def preflight(job: ParallelTrainingJob) -> Path | None:
    """Everything that would make every rank fail at once, checked here and reported once. Returns the
    checkpoint the ranks resume from (verified to load into the model), if any."""
    spec = job.spec
    checkpoint_dir = Path(spec.checkpoint.directory).resolve()
    resume_from = checkpoint.latest(checkpoint_dir) if spec.checkpoint.resume else None
    if spec.training_mode == "custom":
        program = spec.custom.command[0]
        if shutil.which(program) is None:
            raise PreflightError(f"spec.custom.command: {program!r} is not an executable on PATH")
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
    try:
        model = build_model(trainer.model, trainer.model_args)
        for field, ref in (("data", trainer.data), ("evalData", trainer.eval_data)):
            if ref is None:
                continue
            if ref.endswith(".npz"):
                if not Path(ref).is_file():
                    raise PreflightError(f"spec.trainer.{field}: data file {ref!r} does not exist")
            else:
                import_reference(ref)
    except BadReference as error:
        raise PreflightError(f"spec.trainer: {error}") from error
    if resume_from is not None:
        try:
            checkpoint.restore_model(model, checkpoint.load(resume_from)["model"], resume_from)
        except checkpoint.CheckpointError as error:
            raise PreflightError(
                f"cannot resume: {error}. Remove it, or set spec.checkpoint.resume: false to start afresh"
            ) from error
    return resume_from


def _die_with_parent() -> None:
    """Runs in each child before exec: the kernel sends it SIGTERM if the launcher dies (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Launcher:
    def __init__(
        self, job: ParallelTrainingJob, *, run_dir: Path, resume_from: Path | None, grace_seconds: float = 30.0
    ):
        self.job = job
        self.resume_from = resume_from
        self.run_dir = run_dir
        self.grace_seconds = grace_seconds
        self.status_file = run_dir / "status.json"
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.stop_requested_at: float | None = None
        self.master_port: int | None = None

    def environment(self, rank: int, port: int, spec_path: Path) -> dict[str, str]:
        spec = self.job.spec
        contract = WorkerContract.local(
            rank, spec.workers, master_port=port, job=self.job.metadata.name, spec_path=spec_path,
            checkpoint_dir=Path(spec.checkpoint.directory).resolve(), resume_from=self.resume_from,
            status_file=self.status_file,
        )
        return {**os.environ, **{e.name: e.value or "" for e in spec.env}, **contract.to_environ()}

    def start(self) -> None:
        spec_path = self.run_dir / "spec.json"
        spec_path.write_text(json.dumps(self.job.to_dict()))
        port = self.master_port = free_port()
        spec = self.job.spec
        if spec.training_mode == "custom":
            command = [*spec.custom.command, *spec.custom.args]
        else:
            command = [sys.executable, "-m", "tandem.worker", "train"]
        for rank in range(spec.workers):
            log = self.run_dir / f"rank-{rank}.log"
            self.logs.append(log)
            with open(log, "wb") as output:
                self.processes.append(subprocess.Popen(
                    command, env=self.environment(rank, port, spec_path), stdout=output, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent,
                ))

    def request_stop(self, signum=None, frame=None) -> None:  # noqa: ARG002
        if self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
            for process in self.processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)

    def kill_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()

    def wait(self, sink: ConsoleSink) -> tuple[int | None, int]:
        """Until every rank exits; returns (first failed rank or None, its exit code)."""
        last_shown = None
        while True:
            status = read_status_file(self.status_file)
            if status is not None and status.model_dump() != last_shown:
                sink.publish(status)
                last_shown = status.model_dump()
            codes = [process.poll() for process in self.processes]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed and self.stop_requested_at is None:
                self.request_stop()
                self.kill_all()
                return failed[0]
            if all(code is not None for code in codes):
                return (failed[0] if failed else (None, 0))
            if self.stop_requested_at is not None and time.monotonic() - self.stop_requested_at > self.grace_seconds:
                self.kill_all()
                return (None, 0)
            time.sleep(POLL_SECONDS)

    def tail(self, rank: int) -> str:
        lines = self.logs[rank].read_text(errors="replace").splitlines()
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def final_status(self, failed_rank: int | None, code: int) -> ParallelTrainingJobStatus:
        status = read_status_file(self.status_file) or ParallelTrainingJobStatus(start_time=now())
        status.workers.total = self.job.spec.workers
        status.workers.ready = 0
        status.master.address, status.master.port = "127.0.0.1", self.master_port
        if failed_rank is not None:
            status.phase = "Failed"
            status.message = f"rank {failed_rank} exited with code {code}"
            status.completion_time = status.completion_time or now()
        elif self.job.spec.training_mode == "custom":
            status.phase, status.message, status.completion_time = "Succeeded", "all ranks exited 0", now()
        elif status.phase == "Running":
            status.phase = "Suspended" if self.stop_requested_at is not None else "Failed"
            status.message = status.message or "ranks exited before reporting a final status"
        return ParallelTrainingJobStatus.model_validate(status.model_dump())


def run(path: str, *, workers: int | None = None, status_out: str | None = None) -> int:
    try:
        job = load_one(path, ParallelTrainingJob)
        if workers is not None:
            if workers < 1:
                raise PreflightError(f"--workers {workers}: needs at least 1 rank")
            job.spec.workers = workers
        resume_from = preflight(job)
    except (ManifestError, PreflightError) as error:
        print(f"tandem run: {error}", file=sys.stderr)
        return 2

    run_dir = Path(tempfile.mkdtemp(prefix=f"tandem-{job.metadata.name}-"))
    launcher = Launcher(job, run_dir=run_dir, resume_from=resume_from)
    previous = {sig: signal.signal(sig, launcher.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    sink = ConsoleSink(job.metadata.name)
    try:
        launcher.start()
        failed_rank, code = launcher.wait(sink)
    finally:
        launcher.kill_all()
        sink.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    status = launcher.final_status(failed_rank, code)
    if failed_rank is not None:
        print(f"tandem run: rank {failed_rank} failed (exit code {code}); its log {launcher.logs[failed_rank]}:",
              file=sys.stderr)
        print(launcher.tail(failed_rank), file=sys.stderr)
    text = json.dumps(status.to_dict(), indent=2)
    print(text)
    if status_out:
        Path(status_out).write_text(text + "\n")
    if failed_rank is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"Succeeded": 0, "Suspended": INTERRUPTED_EXIT_CODE}.get(status.phase, 1)
