"""The worker contract: everything a worker process learns from its environment, whoever started it.

A rank of a ParallelTrainingJob is configured by environment variables alone, so it runs the same way in a pod
the operator creates, under `tandem run` (one process per rank on this machine), inside `ParallelWrapper`,
and by hand. The names are torchrun's where torchrun has one:

    RANK, WORLD_SIZE            this rank's number (0 is the master) and the group's size
    LOCAL_RANK                  the rank's number on its machine: the GPU it takes (default RANK)
    LOCAL_WORLD_SIZE            ranks on its machine: they split its CPU cores (default WORLD_SIZE)
    GROUP_RANK                  a pod's (machine's) index among the group's pods, in place of RANK and LOCAL_RANK
                                in the environment of a pod hosting several ranks (spec.ranksPerPod > 1): its
                                launcher (`tandem worker launch`) starts LOCAL_WORLD_SIZE ranks, numbered
                                GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK (torchrun's meaning)
    MASTER_ADDR, MASTER_PORT    where rank 0 hosts the group's rendezvous (default 127.0.0.1:29500). On a cluster,
                                rank 0's own DNS name, <pod hostname>.<headless service>: a Service name that
                                selects every rank would round-robin. An elastic job's (spec.elastic, recovery
                                regroup) rendezvous is its coordinator's (`tandem worker coordinator`, configured
                                by MASTER_PORT, WORLD_SIZE and TANDEM_SPEC): under `tandem run` a process beside
                                the ranks, on a cluster the pod <job>-coordinator
    TANDEM_JOB                  the ParallelTrainingJob's name (default "tandem")
    TANDEM_NAMESPACE            its namespace, on a cluster
    TANDEM_SPEC                 path of the job as JSON (the whole resource, or its spec): required
    TANDEM_CHECKPOINT_DIR       where rank 0 writes checkpoints (default: spec.checkpoint.directory)
    TANDEM_RESUME_FROM          the complete checkpoint to resume from; `latest`: the latest complete checkpoint in
                                TANDEM_CHECKPOINT_DIR when there is one (a new job on a claim that holds some, as
                                `checkpoint.resume: true` asks), else start afresh; empty or unset: start afresh
    TANDEM_STATUS_FILE          `tandem run` only: where rank 0 publishes its status for the launcher to show
    TANDEM_RUN_ID               `tandem run` only: the run rank 0 writes checkpoints as; the launcher holds the
                                checkpoint directory's lease and has made it the run's (for a custom command, whose
                                files are its own, the run its lease names: no record is kept). Unset (on a
                                cluster, by hand), rank 0 takes the lease and makes the directory its run's itself
                                (worker/checkpoint_owner.py): a fresh run is named after TANDEM_JOB_UID
    TANDEM_JOB_UID              the ParallelTrainingJob's uid, on a cluster: rank 0 of the same job, restarted,
                                takes over the lease its predecessor held
    TANDEM_REGROUPS_BEFORE      an elastic job's regroups before this group started (status.recoveries.regroups):
                                rank 0 counts on from it; unset: 0
    TANDEM_EXAMPLES_LOG         an elastic job's ranks append a line `<rank> <step> <example index>...` to this
                                file for each step they complete (what each rank trained on, across regroups:
                                for checking that each example of an epoch is taken once); unset: nothing

Ranks other than 0 wait for the master's TCP port (not just its name) with a bounded timeout before joining;
gloo on CPU, NCCL for CUDA tensors when CUDA devices are present, and `trainer.requireGPU: true` makes a CPU
fallback an error before training, never a silent slowdown.

The inference server takes TANDEM_SPEC too: `tandem serve` with no FILE serves the InferencePool at that path.

This module imports neither torch nor tandem.worker: the operator builds pods from it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, NamedTuple

RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
JOB = "TANDEM_JOB"
NAMESPACE = "TANDEM_NAMESPACE"
SPEC = "TANDEM_SPEC"
CHECKPOINT_DIR = "TANDEM_CHECKPOINT_DIR"
RESUME_FROM = "TANDEM_RESUME_FROM"
RESUME_LATEST = "latest"
"""TANDEM_RESUME_FROM's value for "the latest complete checkpoint in the checkpoint directory, if any"."""
STATUS_FILE = "TANDEM_STATUS_FILE"
RUN_ID = "TANDEM_RUN_ID"
JOB_UID = "TANDEM_JOB_UID"
EXAMPLES_LOG = "TANDEM_EXAMPLES_LOG"
REGROUPS_BEFORE = "TANDEM_REGROUPS_BEFORE"

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500  # torchrun's
DEFAULT_JOB = "tandem"


CHECKPOINT_NAME = "step-{step:08d}.pt"
"""A checkpoint's file name in its directory: the step it was written at, so names sort as steps do. Rank 0 writes
them (worker/checkpoint.py); a pool's operator names a pinned one."""


def checkpoint_name(step: int) -> str:
    return CHECKPOINT_NAME.format(step=step)


SERVED_METRIC_PARAMETER = "metric."
"""A server's model metadata carries each metric recorded for the checkpoint it serves as the parameter
`metric.<name>` (the protocol's parameter values are scalars); the operator reads them into status.model.metrics.
With a promotion gate, also `skipped_checkpoint`, `skipped_reason` and `skipped_metric` for status.lastSkipped."""

REFUSED_BATCHING_PARAMETER = "refused_"
"""A server whose model failed its warm-up at the batching settings its pool asks for (`tandem serve --watch-pool`)
reports them, until it runs other settings, as the parameters `refused_<setting>` (`refused_batch_limit`,
`refused_queue_limit`, `refused_max_queue_delay_microseconds`, `refused_request_timeout_ms`) and `refused_reason`
(its error): the operator reads them into the pool's BatchingDiffers condition (reason Refused)."""
REFUSED_RETRY_SECONDS = 30.0
"""How long a server that refused its pool's batching settings waits before trying the same settings again (each try
costs it a warm-up); other settings are tried at once."""


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint file name (`step-00000200.pt`: 200); None for another name."""
    stem = name.removeprefix("step-").removesuffix(".pt")
    return int(stem) if name.startswith("step-") and name.endswith(".pt") and stem.isdigit() else None


INVALID_MODEL_OR_DATA = "InvalidModelOrData"
"""The reason a job fails with when its model or data cannot work (a reference that does not resolve, data without
arrays x and y, data the model cannot take) or its custom command cannot start: a restart would fail the same way."""
CHECKPOINT_DIRECTORY_TAKEN = "CheckpointDirectoryTaken"
"""The reason a job fails with when its checkpoint directory is not its to write (worker/checkpoint_owner.py): another
run's checkpoints are there and it would start afresh (checkpoint.resume false, no checkpoint.overwrite), or another
job holds the directory's lease past the wait: a restart would be refused the same way."""
PERMANENT_FAILURES = (INVALID_MODEL_OR_DATA, CHECKPOINT_DIRECTORY_TAKEN)
"""The reasons of the failures a restart would repeat identically (PermanentFailure)."""
PERMANENT_FAILURE_EXIT_CODE = 78
"""A rank's exit code for a permanent failure (sysexits.h's EX_CONFIG). The job fails at once with its reason,
spending no `backoffLimit`; the rank's output ends with the report (`permanent_failure_report`), which the job's
message leads with."""
GROUP_RESTART_EXIT_CODE = 75
"""An elastic job's rank's exit code when its group cannot regroup (sysexits.h's EX_TEMPFAIL: the coordinator gone,
or a fallback it planned): the whole group restarts from its latest checkpoint; the rank is not replaced alone."""


class GroupMustRestart(RuntimeError):
    """An elastic job's group cannot go on in process (worker/train/membership.py's RegroupFailed): the rank exits
    with GROUP_RESTART_EXIT_CODE."""


class PermanentFailure(ValueError):
    """A failure a restart would repeat identically. A rank that meets one ends its output with its report, a line
    `<reason>: <what is wrong and the fix>` (tandem/worker/train/invalid.py), and exits with
    PERMANENT_FAILURE_EXIT_CODE; `tandem run` fails the job before any rank starts with the same report."""

    reason: ClassVar[str]
    """One of PERMANENT_FAILURES: the failed job's condition reason and the report's first word."""
    names_its_frame: ClassVar[bool] = True
    """Whether the report names the frame that raised it (where a mistake in the job's model or data surfaced); a
    refusal whose message says everything leaves it out."""


class PermanentFailureReport(NamedTuple):
    """A permanent failure, as the output of the rank that met it reports it."""

    reason: str
    """One of PERMANENT_FAILURES."""
    report: str
    """From the line `<reason>: ` (the exception's line) to the end of the output (the frame that raised it)."""


def permanent_failure_report(output: str) -> PermanentFailureReport | None:
    """The report that ends the output of a rank that exited with PERMANENT_FAILURE_EXIT_CODE: from its last line
    starting with one of PERMANENT_FAILURES and `: ` to the end; None without one (exit code 78 alone is an ordinary
    failure: a custom command may use it)."""
    lines = output.rstrip().splitlines()
    for index in range(len(lines) - 1, -1, -1):
        reason = lines[index].partition(": ")[0]
        if reason in PERMANENT_FAILURES and lines[index].startswith(f"{reason}: "):
            return PermanentFailureReport(reason, "\n".join(lines[index:]))
    return None


class ContractError(RuntimeError):
    """The worker's environment does not satisfy the contract, or the group it describes cannot form."""


@dataclass(frozen=True)
class WorkerContract:
    """One rank's view of the contract. `spec_path` is None only for ranks handed their spec in process
    (ParallelWrapper, benchmarks); `from_environ` requires it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    job: str = DEFAULT_JOB
    namespace: str | None = None
    spec_path: Path | None = None
    checkpoint_dir: Path | None = None
    resume_from: Path | None = None
    resume_latest: bool = False
    """Resume from the latest complete checkpoint in `checkpoint_dir`, if any (when `resume_from` is None)."""
    status_file: Path | None = None
    run_id: str | None = None
    job_uid: str | None = None
    examples_log: Path | None = None
    regroups_before: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ContractError(f"{RANK}={self.rank} must be in 0..{WORLD_SIZE}-1 ({WORLD_SIZE}={self.world_size})")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ContractError(f"{LOCAL_RANK}={self.local_rank} must be in 0..{LOCAL_WORLD_SIZE}-1 "
                                f"({LOCAL_WORLD_SIZE}={self.local_world_size})")

    @classmethod
    def local(cls, rank: int, world_size: int, **fields) -> WorkerContract:
        """A rank of a group on this one machine (every rank local to it)."""
        return cls(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size, **fields)

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerContract:
        env = os.environ if environ is None else environ
        rank, world_size = _integer(env, RANK), _integer(env, WORLD_SIZE)
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=_integer(env, LOCAL_RANK, rank),
            local_world_size=_integer(env, LOCAL_WORLD_SIZE, world_size),
            master_addr=env.get(MASTER_ADDR) or DEFAULT_MASTER_ADDR,
            master_port=_integer(env, MASTER_PORT, DEFAULT_MASTER_PORT),
            job=env.get(JOB) or DEFAULT_JOB,
            namespace=env.get(NAMESPACE) or None,
            spec_path=Path(_required(env, SPEC)),
            checkpoint_dir=_path(env, CHECKPOINT_DIR),
            resume_from=None if env.get(RESUME_FROM) == RESUME_LATEST else _path(env, RESUME_FROM),
            resume_latest=env.get(RESUME_FROM) == RESUME_LATEST,
            status_file=_path(env, STATUS_FILE),
            run_id=env.get(RUN_ID) or None,
            job_uid=env.get(JOB_UID) or None,
            examples_log=_path(env, EXAMPLES_LOG),
            regroups_before=_integer(env, REGROUPS_BEFORE, 0),
        )

    @classmethod
    def local_ranks_from_environ(cls, environ: Mapping[str, str] | None = None) -> list[WorkerContract]:
        """What a pod hosting several ranks starts: each of its ranks' contract, read from the pod's environment
        (`pod_environ`: GROUP_RANK and LOCAL_WORLD_SIZE in place of RANK and LOCAL_RANK)."""
        env = os.environ if environ is None else environ
        group_rank, local_world_size = _integer(env, GROUP_RANK), _integer(env, LOCAL_WORLD_SIZE)
        world_size = _integer(env, WORLD_SIZE)
        if local_world_size < 1 or world_size % local_world_size:
            raise ContractError(f"{WORLD_SIZE}={world_size} is not a multiple of {LOCAL_WORLD_SIZE}="
                                f"{local_world_size} (every pod hosts as many ranks)")
        if not 0 <= group_rank < world_size // local_world_size:
            raise ContractError(f"{GROUP_RANK}={group_rank} must be in 0..{world_size // local_world_size - 1} "
                                f"({WORLD_SIZE}={world_size} ranks in pods of {LOCAL_WORLD_SIZE}={local_world_size})")
        first = cls.from_environ({**env, RANK: str(group_rank * local_world_size), LOCAL_RANK: "0"})
        return [replace(first, rank=first.rank + local, local_rank=local) for local in range(local_world_size)]

    def to_environ(self) -> dict[str, str]:
        """The variables that carry this contract (unset optional ones left out; TANDEM_RESUME_FROM is always
        there, empty for a fresh start, so a pod's environment shows which it is)."""
        environ = {
            RANK: str(self.rank), WORLD_SIZE: str(self.world_size),
            LOCAL_RANK: str(self.local_rank), LOCAL_WORLD_SIZE: str(self.local_world_size),
            MASTER_ADDR: self.master_addr, MASTER_PORT: str(self.master_port),
            JOB: self.job, RESUME_FROM: str(self.resume_from or (RESUME_LATEST if self.resume_latest else "")),
        }
        optional = {NAMESPACE: self.namespace, SPEC: self.spec_path, CHECKPOINT_DIR: self.checkpoint_dir,
                    STATUS_FILE: self.status_file, RUN_ID: self.run_id, JOB_UID: self.job_uid,
                    EXAMPLES_LOG: self.examples_log, REGROUPS_BEFORE: self.regroups_before or None}
        environ.update({name: str(value) for name, value in optional.items() if value is not None})
        return environ

    def pod_environ(self) -> dict[str, str]:
        """The environment of the pod hosting this rank and its LOCAL_WORLD_SIZE - 1 local peers: `to_environ`'s,
        with GROUP_RANK (the pod's index) in place of RANK and LOCAL_RANK, which its launcher gives each rank."""
        environ = self.to_environ()
        del environ[RANK], environ[LOCAL_RANK]
        return {GROUP_RANK: str(self.rank // self.local_world_size), **environ}


def _required(env: Mapping[str, str], name: str) -> str:
    if not env.get(name):
        raise ContractError(f"environment variable {name} is not set (the worker contract: tandem/contract.py)")
    return env[name]


def _integer(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name) or (str(default) if default is not None else _required(env, name))
    try:
        return int(text)
    except ValueError:
        raise ContractError(f"environment variable {name}={text!r} is not an integer") from None


def _path(env: Mapping[str, str], name: str) -> Path | None:
    return Path(env[name]) if env.get(name) else None
