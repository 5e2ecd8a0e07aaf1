"""Who a checkpoint directory belongs to: the run that writes its checkpoints, and the one process writing now.

A run is one line of training: started afresh, continued by every resume and restart. Its record, `tandem-run.json`
in the directory, names it (`run`: the job's uid on a cluster, a generated id locally; a resume keeps the recorded
one) and lists the checkpoints it wrote, oldest first, so that `keepLast` and "latest" never count another run's
files. A run starting afresh in a directory holding another run's checkpoints is refused, or with
`checkpoint.overwrite` moves them aside into a subdirectory named after that run (`plan_directory`).

One writer at a time: the lease, `tandem-lease.json`, names its holder (host, pid and its start time, run, job,
since, renewed). The holder renews it every LEASE_RENEW_SECONDS and removes it when done. Anyone else is refused while
it holds it, unless the lease is stale. On the holder's host (and pid namespace) that is when its process is gone: a
live holder keeps it however long since it renewed (one stopped with SIGSTOP, say), and a process that has since been
given its pid is not it (its start time differs). Seen from another host, whose pids mean nothing here, it is when
the lease has not been renewed for LEASE_STALE_SECONDS. A holder with the same job uid (rank 0 of the same job,
restarted on a cluster) takes it over at once. `tandem run` and ParallelWrapper take it in the launcher, before any
rank starts; on a cluster rank 0 takes it. A writer whose lease another has taken over (it stopped renewing it, seen
from another host) is refused its next checkpoint (`record_written`), even where the new holder resumed its run.

This module imports neither torch nor the trainer: the launcher uses it before any rank starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

from tandem.contract import CHECKPOINT_DIRECTORY_TAKEN, PermanentFailure, checkpoint_step

RUN_FILE = "tandem-run.json"
LEASE_FILE = "tandem-lease.json"
LOCK_FILE = ".tandem-lease.lock"
LEASE_RENEW_SECONDS = 10.0
LEASE_STALE_SECONDS = 60.0
"""A lease not renewed for this long is stale: its holder is taken to be gone (six renewals missed)."""
ASIDE_PREFIX = "run-"
NAMES_SHOWN = 4


class OwnershipError(PermanentFailure):
    """The checkpoint directory is not this run's to write: held by another writer, or holding another run. A
    permanent failure (CheckpointDirectoryTaken): the job fails at once, its message this one, which names the
    directory, who holds it and the fix."""

    reason = CHECKPOINT_DIRECTORY_TAKEN
    names_its_frame = False


class _Record(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2) + "\n"


class RunRecord(_Record):
    """`tandem-run.json`: the run whose checkpoints the directory holds."""

    run: str
    job: str
    uid: str | None = None
    """The job's uid on a cluster (the job that started the run)."""
    started: datetime
    checkpoints: list[str] = []
    """The checkpoint files this run wrote that keepLast has kept, in the order written (the last is the latest)."""


class Lease(_Record):
    """`tandem-lease.json`: the one process writing the directory now."""

    host: str
    pid: int
    pid_namespace: str = ""
    """The holder's pid namespace (a pod's own): its pid means something only to a process in the same one."""
    pid_started: int | None = None
    """When the holder's process started (/proc/PID/stat's starttime, clock ticks after boot; None where there is no
    /proc): a later process given the same pid is not the holder."""
    run: str
    job: str
    uid: str | None = None
    since: datetime
    renewed: datetime

    @property
    def holding(self) -> tuple[str, str, int, datetime]:
        """Which holding of the directory this lease is: the process (host, pid namespace, pid) and since when it
        holds it. Renewing the lease, or naming another run in it, keeps it; a takeover is another."""
        return self.host, self.pid_namespace, self.pid, self.since

    def describe(self, now: datetime) -> str:
        renewed = max(0, round((now - self.renewed).total_seconds()))
        return (f"pid {self.pid} on host {self.host} (run {self.run}, job {self.job}) since "
                f"{self.since:%Y-%m-%d %H:%M:%S} UTC, renewed {renewed} s ago")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def this_process(run: str, job: str, uid: str | None) -> Lease:
    """A lease naming this process as holder, from now."""
    started = now()
    return Lease(host=socket.gethostname(), pid=os.getpid(), pid_namespace=_pid_namespace(),
                 pid_started=process_started(os.getpid()), run=run, job=job, uid=uid, since=started, renewed=started)


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def process_started(pid: int) -> int | None:
    """When process `pid` started: /proc/PID/stat's field 22 (starttime, clock ticks after boot); None where /proc
    does not say (no such process, or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command's name, which may hold spaces and parentheses
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def holder_alive(held: Lease) -> bool:
    """Whether the process holding `held` (one of this process's pid space) still runs: its pid is alive and, where
    the lease records it, started when the holder's did (not a later process given the same pid)."""
    if not pid_alive(held.pid):
        return False
    started = process_started(held.pid)
    return held.pid_started is None or started is None or started == held.pid_started


def lease_blocks(held: Lease | None, me: Lease, at: datetime, *,
                 alive: Callable[[Lease], bool] = holder_alive) -> bool:
    """Whether `held` keeps `me` from writing the directory: true unless there is none, it is mine, its job's (the
    same uid: rank 0 of the same job restarted), or stale: on this host (and pid namespace) its process gone (`alive`
    says), however long since it renewed; from another host, not renewed for LEASE_STALE_SECONDS."""
    if held is None:
        return False
    same_process_space = (held.host, held.pid_namespace) == (me.host, me.pid_namespace)
    if same_process_space and held.pid == me.pid:
        return False
    if held.uid is not None and held.uid == me.uid:
        return False
    if same_process_space:
        return alive(held)
    return (at - held.renewed).total_seconds() <= LEASE_STALE_SECONDS


def _read(path: Path, model: type[_Record]) -> _Record | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return model.model_validate_json(text)
    except ValidationError as error:
        raise OwnershipError(f"{path}: not a readable {path.name} ({error.error_count()} problems, first: "
                             f"{error.errors()[0]['msg']}); if no Tandem run uses this directory, delete it") from None


def _write(path: Path, record: _Record) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(record.to_json())
    os.replace(temporary, path)


def read_run(directory: Path) -> RunRecord | None:
    return _read(directory / RUN_FILE, RunRecord)


def write_run(directory: Path, record: RunRecord) -> None:
    _write(directory / RUN_FILE, record)


def read_lease(directory: Path) -> Lease | None:
    return _read(directory / LEASE_FILE, Lease)


def _read_lease_quietly(directory: Path) -> Lease | None:
    """The directory's lease; None for an unreadable one too."""
    try:
        return read_lease(directory)
    except OwnershipError:
        return None


@contextlib.contextmanager
def _deciding(directory: Path) -> Iterator[None]:
    """Serialises the decisions about the lease (read, judge, write) of every process taking it. A file opened for
    writing: NFS (where claims often live) locks only those."""
    with open(directory / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def in_use_message(directory: Path, held: Lease, at: datetime) -> str:
    return (f"spec.checkpoint.directory {directory} is in use by another run: held by {held.describe(at)}. Wait for "
            f"it to end (or stop it), or give this job another spec.checkpoint.directory. A lease whose process is "
            f"gone, or one from another host not renewed for {LEASE_STALE_SECONDS:.0f} s, is taken over.")


def try_take_lease(directory: Path, me: Lease) -> Lease | None:
    """Take the lease for `me`; returns the lease that blocks it instead, if one does."""
    with _deciding(directory):
        held = read_lease(directory)
        if lease_blocks(held, me, now()):
            return held
        _write(directory / LEASE_FILE, me)
        return None


@dataclass
class LeaseKeeper:
    """Holds the directory's lease: renews it on a thread of its own while it is still this holder's, and removes
    it on release, with the directory if taking the lease created it and it is still empty (a run refused before it
    started leaves nothing behind)."""

    directory: Path
    lease: Lease
    created: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> LeaseKeeper:
        self._thread = threading.Thread(target=self._renew, name="tandem-lease", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        """Until released, or the lease is no longer this holder's (taken over as stale, or the directory gone)."""
        while not self._stop.wait(LEASE_RENEW_SECONDS):
            try:
                with _deciding(self.directory):
                    if not self._mine():
                        return
                    self.lease = self.lease.model_copy(update={"renewed": now()})
                    _write(self.directory / LEASE_FILE, self.lease)
            except OSError:
                return

    def name_run(self, run: str) -> None:
        """The lease names `run` from now (the run the holder decided to write as, once it held the lease)."""
        with _deciding(self.directory):
            if self._mine() and self.lease.run != run:
                self.lease = self.lease.model_copy(update={"run": run})
                _write(self.directory / LEASE_FILE, self.lease)

    def _mine(self) -> bool:
        held = _read_lease_quietly(self.directory)
        return held is not None and (held.host, held.pid_namespace, held.pid) == \
            (self.lease.host, self.lease.pid_namespace, self.lease.pid)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(OSError), _deciding(self.directory):
            if self._mine():
                (self.directory / LEASE_FILE).unlink()
        if self.created:
            with contextlib.suppress(OSError):
                if [path.name for path in self.directory.iterdir()] == [LOCK_FILE]:
                    (self.directory / LOCK_FILE).unlink()
                    self.directory.rmdir()


def take_lease(directory: Path, me: Lease, *, wait_seconds: float = 0.0,
               waiting: Callable[[Lease], None] = lambda held: None) -> LeaseKeeper:
    """The directory's lease for `me`, renewed until released; waits up to `wait_seconds` for a holder to release it
    or go stale (`waiting` is told who holds it, once), then OwnershipError naming the holder."""
    deadline = time.monotonic() + wait_seconds
    told = False
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    while (held := try_take_lease(directory, me)) is not None:
        if time.monotonic() >= deadline:
            raise OwnershipError(in_use_message(directory, held, now()))
        if not told:
            waiting(held)
            told = True
        time.sleep(1.0)
    return LeaseKeeper(directory, me, created).start()


def step_files(directory: Path) -> list[str]:
    """The checkpoint files in `directory` (any run's), by step."""
    if not directory.is_dir():
        return []
    return sorted((p.name for p in directory.iterdir() if checkpoint_step(p.name) is not None), key=checkpoint_step)


def run_files(directory: Path) -> list[str]:
    """The directory's run's checkpoints that exist, oldest first: those its record lists; in a directory without a
    record (written before runs were recorded), every checkpoint in it, by step."""
    record = read_run(directory)
    if record is None:
        return step_files(directory)
    return [name for name in record.checkpoints if (directory / name).is_file()]


@dataclass(frozen=True)
class DirectoryPlan:
    """What a run does with its checkpoint directory before it starts: the run it writes as (`run`, written as the
    directory's record), and another run's checkpoints it moves aside first, with that run's record (`set_aside`,
    into the subdirectory `aside_into`)."""

    run: RunRecord
    set_aside: tuple[str, ...] = ()
    aside_into: str | None = None


def plan_directory(directory: Path, recorded: RunRecord | None, present: list[str], *, fresh: RunRecord,
                   resume: bool, overwrite: bool, existing: Set[str] = frozenset()) -> DirectoryPlan:
    """How a run begins in `directory`, which holds the run `recorded` (if any) and the checkpoint files `present`.

    - its own run (`recorded` has `fresh`'s id: rank 0 of the same job restarted), or resuming a recorded run:
      carry on as that run, keeping its id;
    - resuming in a directory with checkpoints but no record (written before runs were recorded): a new run that
      adopts them;
    - starting afresh (`fresh`) where no checkpoint is: the new run;
    - starting afresh where another run's checkpoints are: refused (OwnershipError naming them and the fix), or
      with `overwrite` they and their record are moved aside into `run-<that run's id>` (`existing`: the names
      already in the directory, which the subdirectory's must not be).
    """
    if recorded is not None and (resume or recorded.run == fresh.run):
        return DirectoryPlan(recorded)
    if resume and present:
        return DirectoryPlan(fresh.model_copy(update={"checkpoints": present}))
    if not present:
        return DirectoryPlan(fresh)
    owner = f"run {recorded.run} of job {recorded.job}" if recorded is not None else "a run that left no record"
    aside = aside_directory(recorded.run if recorded is not None else "unrecorded", existing)
    if not overwrite:
        raise OwnershipError(
            f"spec.checkpoint.directory {directory} holds another run's checkpoints ({owner}: {names_text(present)}) "
            f"and spec.checkpoint.resume is false: this run's checkpoints would be mixed with them. Give this job "
            f"another spec.checkpoint.directory, or delete them, or set spec.checkpoint.overwrite: true to move them "
            f"into {directory / aside} (nothing is deleted); spec.checkpoint.resume: true continues that run instead")
    return DirectoryPlan(fresh, tuple(present), aside)


def names_text(names: list[str]) -> str:
    """`step-00002700.pt, ..., step-00002860.pt (5 files)`: the first and last few, and how many."""
    shown = names if len(names) <= NAMES_SHOWN else [*names[:NAMES_SHOWN - 1], "...", names[-1]]
    return f"{', '.join(shown)} ({len(names)} file{'s' if len(names) != 1 else ''})"


def aside_directory(run: str, existing: Set[str]) -> str:
    """`run-<id>`, or `run-<id>-2`, `-3`... when that name is taken."""
    name, number = f"{ASIDE_PREFIX}{run}", 1
    while name in existing:
        number += 1
        name = f"{ASIDE_PREFIX}{run}-{number}"
    return name


def apply_plan(directory: Path, plan: DirectoryPlan) -> None:
    """Move `plan.set_aside` aside and write the run's record (only when it changed: a complete run resumed leaves
    the directory as it is)."""
    directory.mkdir(parents=True, exist_ok=True)
    if plan.set_aside:
        aside = directory / plan.aside_into
        aside.mkdir()
        for name in (*plan.set_aside, RUN_FILE):
            if (directory / name).exists():
                shutil.move(directory / name, aside / name)
    if read_run(directory) != plan.run:
        write_run(directory, plan.run)


def prepare(directory: Path, *, fresh: RunRecord, resume: bool, overwrite: bool) -> DirectoryPlan:
    """`plan_directory` for `directory` as it is now."""
    existing = {p.name for p in directory.iterdir()} if directory.is_dir() else set()
    return plan_directory(directory, read_run(directory), step_files(directory), fresh=fresh, resume=resume,
                          overwrite=overwrite, existing=existing)


def claim(directory: Path, fresh: RunRecord, *, resume: bool, overwrite: bool, record: bool = True,
          wait_seconds: float = 0.0, waiting: Callable[[Lease], None] = lambda held: None,
          ) -> tuple[LeaseKeeper, DirectoryPlan | None]:
    """The directory's lease for run `fresh` (take_lease) and how the run begins there (prepare; None without
    `record`: a custom command's files are its own), the lease released again if the plan is refused. The lease
    names the run the plan writes as."""
    keeper = take_lease(directory, this_process(fresh.run, fresh.job, fresh.uid), wait_seconds=wait_seconds,
                        waiting=waiting)
    try:
        plan = prepare(directory, fresh=fresh, resume=resume, overwrite=overwrite) if record else None
    except BaseException:
        keeper.release()
        raise
    if plan is not None:
        keeper.name_run(plan.run.run)
    return keeper, plan


def begin(directory: Path, plan: DirectoryPlan, who: str) -> None:
    """apply_plan, saying (as `who`, on stderr) where it moved another run's checkpoints."""
    apply_plan(directory, plan)
    if plan.set_aside:
        print(f"{who}: moved another run's checkpoints ({names_text(list(plan.set_aside))}) into "
              f"{directory / plan.aside_into} (spec.checkpoint.overwrite)", file=sys.stderr, flush=True)


def record_written(directory: Path, name: str, run: str, holder: Lease | None = None) -> None:
    """Add `name` to the run's record as its latest, before the file appears under that name: a checkpoint is
    never in the directory without being counted as the run's. Refused when the directory has become another run's
    (`run`: the writer's), or when the lease the writer writes under (`holder`: its own, or its launcher's) is no
    longer the directory's: its holder stopped renewing it (stopped, or cut off, for longer than
    LEASE_STALE_SECONDS, seen from another host) and another took it over, perhaps resuming the same run."""
    if holder is not None:
        held = _read_lease_quietly(directory)
        if held is None or held.holding != holder.holding:
            now_held = f"now held by {held.describe(now())}" if held is not None else "gone"
            raise OwnershipError(f"{directory}: this run ({run}) lost the directory's lease ({now_held}): not "
                                 f"writing {name}")
    record = read_run(directory)
    if record is None:
        raise OwnershipError(f"{directory}: its {RUN_FILE} is gone: this run ({run}) no longer owns the directory")
    if record.run != run:
        raise OwnershipError(f"{directory} now belongs to run {record.run} (job {record.job}), not to this run "
                             f"({run}): not writing {name}")
    record.checkpoints = [*(n for n in record.checkpoints if n != name), name]
    write_run(directory, record)


def forget(directory: Path, names: list[str]) -> None:
    """Drop `names` (pruned) from the run's record."""
    record = read_run(directory)
    if record is not None:
        record.checkpoints = [n for n in record.checkpoints if n not in names]
        write_run(directory, record)
