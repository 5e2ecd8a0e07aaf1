"""One group of ranks for `tandem run`: `spec.workers` processes on this machine, started with the worker contract,
watched until they end, stopped together.

Each rank runs `tandem worker train` (or the custom command) with the environment a pod gets, in a session of its
own, so that stopping the group reaches whatever a rank started too; the kernel signals every rank when the
launcher dies (PR_SET_PDEATHSIG), so none outlives it. Rank 0's status file is rendered as it changes, and its
`tandem worker: ...` lines (warnings, the world-size line of a resized resume) are shown as they appear.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.api import ParallelTrainingJob, ParallelTrainingJobStatus
from tandem.contract import WorkerContract
from tandem.worker.train.process_group import free_port
from tandem.worker.train.reporting import read_status_file

POLL_SECONDS = 0.2
LOG_TAIL_LINES = 30
SHOWN_PREFIX = "tandem worker: "
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in each child before exec: the kernel sends it SIGTERM if the launcher dies (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class GroupExit:
    """How a group ended: every rank exited 0 (failed_rank None), or the first rank seen failing and its code."""

    failed_rank: int | None = None
    code: int = 0

    @property
    def cause(self) -> str:
        """The failure in the restart policy's words."""
        how = f"exited with code {self.code}"
        if self.code < 0:
            how += f" (killed by {signal.Signals(-self.code).name})"
        return f"rank {self.failed_rank} {how}"


class Launcher:
    """The ranks of one group, their logs and rank 0's status file, all in `run_dir`."""

    def __init__(self, job: ParallelTrainingJob, *, run_dir: Path, resume_from: Path | None,
                 grace_seconds: float = 30.0):
        self.job = job
        self.resume_from = resume_from
        self.run_dir = run_dir
        self.grace_seconds = grace_seconds
        self.status_file = run_dir / "status.json"
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.stopping_since: float | None = None
        self.master_port: int | None = None
        self.status: ParallelTrainingJobStatus | None = None
        """Rank 0's latest status."""
        self.exits: list[tuple[int, int]] = []
        """(rank, exit code) in the order the ranks exited: the first to fail is the cause, not the ranks that
        failed because it did (a rank whose peer is gone fails too, often within the same poll)."""
        self._shown_up_to = 0

    def environment(self, rank: int, port: int, spec_path: Path) -> dict[str, str]:
        spec = self.job.spec
        contract = WorkerContract.local(
            rank, spec.workers, master_port=port, job=self.job.metadata.name, spec_path=spec_path,
            checkpoint_dir=Path(spec.checkpoint.directory).resolve(), resume_from=self.resume_from,
            status_file=self.status_file,
        )
        return {**os.environ, **{e.name: e.value or "" for e in spec.env}, **contract.to_environ()}

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
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
                process = subprocess.Popen(
                    command, env=self.environment(rank, port, spec_path), stdout=output, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent,
                )
            self.processes.append(process)
            threading.Thread(target=self._watch, args=(rank, process), name=f"tandem-rank-{rank}", daemon=True).start()

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        self.exits.append((rank, process.wait()))

    def stop(self) -> None:
        """Ask every rank to stop (SIGTERM: they agree on a step and write a final checkpoint); `wait` kills them
        once the grace period is over."""
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
            for process in self.processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)

    def kill_all(self) -> None:
        """SIGKILL to each rank's whole session (what it started too), then reap the ranks."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the rank and all it started are gone
                os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            process.wait()

    def wait(self, show: Callable[[ParallelTrainingJobStatus], None], say: Callable[[str], None],
             past_deadline: Callable[[], bool]) -> GroupExit:
        """Until every rank has exited, or one fails (the others are killed at once: the group restarts as a
        whole). Shows rank 0's status and lines as they change; past the deadline, stops the group."""
        while True:
            self.refresh(show, say)
            exits = list(self.exits)
            failed = [(rank, code) for rank, code in exits if code != 0]
            if failed and self.stopping_since is None:
                self.kill_all()
                self.refresh(show, say)
                return GroupExit(*failed[0])
            if len(exits) == len(self.processes):
                self.refresh(show, say)
                return GroupExit(*failed[0]) if failed else GroupExit()
            if self.stopping_since is None and past_deadline():
                self.stop()
            if self.stopping_since is not None and time.monotonic() - self.stopping_since > self.grace_seconds:
                self.kill_all()
                self.refresh(show, say)
                return GroupExit()
            time.sleep(POLL_SECONDS)

    def refresh(self, show: Callable[[ParallelTrainingJobStatus], None], say: Callable[[str], None]) -> None:
        status = read_status_file(self.status_file)
        if status is not None and (self.status is None or status.model_dump() != self.status.model_dump()):
            self.status = status
            show(status)
        for line in self._new_lines():
            if line.startswith(SHOWN_PREFIX):
                say(line)

    def _new_lines(self) -> list[str]:
        """Rank 0's complete log lines written since the last call."""
        if not self.logs:
            return []
        try:
            with open(self.logs[0], "rb") as log:
                log.seek(self._shown_up_to)
                text = log.read()
        except OSError:
            return []
        complete = text[:text.rfind(b"\n") + 1]
        self._shown_up_to += len(complete)
        return complete.decode(errors="replace").splitlines()

    def tail(self, rank: int) -> str:
        lines = self.logs[rank].read_text(errors="replace").splitlines()
        return "\n".join(lines[-LOG_TAIL_LINES:])
