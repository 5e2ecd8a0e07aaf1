"""`tandem worker launch`: the entry point of a pod hosting several ranks (spec.ranksPerPod > 1), as torchrun is a
node's with `--nproc-per-node`.

The pod's environment is the worker contract with GROUP_RANK (the pod's index) in place of RANK and LOCAL_RANK
(tandem/contract.py). The launcher starts LOCAL_WORLD_SIZE ranks through the group supervisor `tandem run` uses
(tandem.worker.local_group), each with its RANK and LOCAL_RANK (and the pod's GROUP_RANK, as torchrun's workers
have it): each trains on cuda:LOCAL_RANK with every GPU of the pod visible (so NCCL finds the peer links between
them), on its share of the pod's cores, and rank 0's status sink runs only in global rank 0. Their output is the
pod's log, each line prefixed with its rank.

SIGTERM (the pod deleted, the job suspended or resized) reaches every local rank: they agree on a step and
checkpoint, as ranks in pods of their own do. A local rank that fails ends its siblings, and the pod exits with its
code (128 + the signal's number for a signal) and a termination message naming the global rank, the local rank, the
cause and the end of its log: the job's message names them as it names a failed single-rank pod.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
from pathlib import Path

from tandem.contract import ContractError, WorkerContract
from tandem.worker.local_group import GroupExit, LocalGroup, rank_command
from tandem.worker.train.entrypoint import load_job

TERMINATION_LOG = Path("/dev/termination-log")
"""A container's terminationMessagePath by default; the kubelet reports what is written there as the message."""
TERMINATION_MESSAGE_BYTES = 4096
"""The most of it the kubelet keeps."""


def termination_message(ended: GroupExit, log_tail: str) -> str:
    """`rank 3 (local rank 1) exited with code 1` and, after a newline, the end of that rank's log, within the
    kubelet's limit (the head line is always whole)."""
    head = ended.cause
    room = TERMINATION_MESSAGE_BYTES - len(head.encode()) - 1
    tail = log_tail.encode()[-room:].decode(errors="ignore") if room > 0 else ""
    return f"{head}\n{tail}" if tail else head


def exit_code(code: int) -> int:
    """A rank's exit code as a shell would report it: 128 + the signal's number for a rank killed by one."""
    return 128 - code if code < 0 else code


def launch(termination_log: Path = TERMINATION_LOG) -> int:
    try:
        contracts = WorkerContract.local_ranks_from_environ()
        job = load_job(contracts[0])
    except (ContractError, OSError, ValueError) as error:
        print(f"tandem worker launch: {error}", file=sys.stderr, flush=True)
        return 2
    group = LocalGroup(rank_command(job.spec), contracts, environ=os.environ,
                       log_dir=Path(tempfile.mkdtemp(prefix="tandem-ranks-")), echo=True, own_sessions=False,
                       parent_death_signal=signal.SIGKILL, grace_seconds=None)
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, lambda signum, frame: group.stop())
    group.start()
    ended = group.wait()
    if ended.failed_rank is None:
        return 0
    message = termination_message(ended, group.tail(ended.failed_rank))
    print(f"tandem worker launch: {ended.cause}; the pod's other ranks were stopped", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):  # run by hand, outside a container: stderr has said it
        termination_log.write_text(message, encoding="utf-8")  # as measured against the limit
    return exit_code(ended.code)
