"""One group of ranks for `tandem run`: `spec.workers` processes on this machine, started by the worker's group
supervisor (tandem.worker.local_group, which a pod hosting several ranks uses too) with the environment a pod gets.

Every rank is local to this one machine: LOCAL_RANK is the rank and LOCAL_WORLD_SIZE the group's size, whatever
`spec.ranksPerPod` says (they split this machine's cores, and with GPUs each takes its own). Each rank runs in a
session of its own, so that stopping the group reaches whatever a rank started too. Rank 0's status file is rendered
as it changes, and its `tandem worker: ...` lines (warnings, the world-size line of a resized resume) are shown as
they appear.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from tandem.api import ParallelTrainingJob, ParallelTrainingJobStatus
from tandem.contract import JOB, MASTER_PORT, SPEC, WORLD_SIZE, WorkerContract
from tandem.worker.local_group import GroupExit, LocalGroup, rank_command
from tandem.worker.train.process_group import free_port
from tandem.worker.train.reporting import read_status_file

SHOWN_PREFIX = "tandem worker: "


class Launcher(LocalGroup):
    """The ranks of one group, their logs and rank 0's status file, all in `run_dir`."""

    def __init__(self, job: ParallelTrainingJob, *, run_dir: Path, resume_from: Path | None, run: str | None,
                 grace_seconds: float = 30.0, regroups_before: int = 0):
        spec = job.spec
        self.job = job
        self.run_dir = run_dir
        self.status_file = run_dir / "status.json"
        self.master_port = free_port()
        spec_path = run_dir / "spec.json"
        contracts = [WorkerContract.local(
            rank, spec.workers, master_port=self.master_port, job=job.metadata.name, spec_path=spec_path,
            checkpoint_dir=Path(spec.checkpoint.directory).resolve(), resume_from=resume_from,
            status_file=self.status_file, run_id=run, regroups_before=regroups_before,
        ) for rank in range(spec.workers)]
        super().__init__(rank_command(spec), contracts,
                         environ={**os.environ, **{e.name: e.value or "" for e in spec.env}}, log_dir=run_dir,
                         grace_seconds=grace_seconds,
                         coordinator={MASTER_PORT: str(self.master_port), WORLD_SIZE: str(spec.workers),
                                      SPEC: str(spec_path), JOB: job.metadata.name} if spec.regroups else None)
        self.status: ParallelTrainingJobStatus | None = None
        """Rank 0's latest."""
        self._shown_up_to = [0] * spec.workers
        self._shown: set[str] = set()
        self._replacements_shown = 0

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "spec.json").write_text(json.dumps(self.job.to_dict()))
        super().start()

    def wait(self, show: Callable[[ParallelTrainingJobStatus], None], say: Callable[[str], None],
             past_deadline: Callable[[], bool]) -> GroupExit:
        """As LocalGroup.wait, showing rank 0's status and lines as they change."""
        return super().wait(on_poll=lambda: self.refresh(show, say), past_deadline=past_deadline)

    def refresh(self, show: Callable[[ParallelTrainingJobStatus], None], say: Callable[[str], None]) -> None:
        status = read_status_file(self.status_file)
        if status is not None and (self.status is None or status.model_dump() != self.status.model_dump()):
            self.status = status
            show(status)
        for line in self._new_lines():
            if line.startswith(SHOWN_PREFIX):
                say(line)
        for index, code in self.replaced[self._replacements_shown:]:
            self._replacements_shown += 1
            say(f"{GroupExit(self.contracts[index].rank, code).cause}: started a replacement, which joins the others "
                "(elastic: they regroup without it meanwhile)")

    def _new_lines(self) -> list[str]:
        """The complete log lines written since the last call: rank 0's; an elastic job's, every rank's not shown
        before (rank 0 moves to another rank when it is lost, and every rank prints the same warnings)."""
        lines = []
        for index, log in enumerate(self.logs if self.replaces_lost else self.logs[:1]):
            try:
                with open(log, "rb") as output:
                    output.seek(self._shown_up_to[index])
                    text = output.read()
            except OSError:
                continue
            complete = text[:text.rfind(b"\n") + 1]
            self._shown_up_to[index] += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                if not self.replaces_lost or line not in self._shown:
                    self._shown.add(line)
                    lines.append(line)
        return lines
