"""The group supervisor (tandem.worker.local_group) that `tandem run` and a pod of several ranks share, with ranks
that are small Python programs ending as ranks do when the kernel ends them: killed by a signal. Which rank it names
as the group's failure, and how, and that the other ranks are killed at once. The supervisor under `tandem run` is
in test_local_restarts.py, in a pod (its exit code and termination message) in test_ranks_per_pod.py."""

from __future__ import annotations

import signal
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from serving import wait_until

from tandem.contract import WorkerContract
from tandem.worker.local_group import GroupExit, LocalGroup


def start_group(tmp_path: Path, program: str, *args: str, world_size: int) -> LocalGroup:
    """`world_size` ranks on this machine, each running `program` (which reads its RANK) with `args`."""
    contracts = [WorkerContract.local(rank, world_size, job="group") for rank in range(world_size)]
    group = LocalGroup([sys.executable, "-c", textwrap.dedent(program), *args], contracts, environ={},
                       log_dir=tmp_path / "logs")
    group.start()
    return group


KILLED = """
    import os, resource, signal, sys, time
    if os.environ["RANK"] == "1":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
        os.kill(os.getpid(), int(sys.argv[1]))
    time.sleep(60)
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV], ids=["oom-killed", "segfault"])
def test_a_rank_killed_by_a_signal_is_the_failure_named_with_its_signal_and_the_others_are_killed_at_once(
        tmp_path, signum):
    """Rank 1 is killed (as the OOM killer kills, or as a segfault ends a process); ranks 0 and 2 would sleep for a
    minute: killed by the supervisor (SIGKILL), not waited for (they would exit 0)."""
    group = start_group(tmp_path, KILLED, str(int(signum)), world_size=3)
    ended = group.wait()
    assert ended == GroupExit(failed_rank=1, code=-signum)
    assert ended.cause == f"rank 1 exited with code {-signum} (killed by {signum.name})"
    assert [process.returncode for process in group.processes] == [-signal.SIGKILL, -signum, -signal.SIGKILL]


LOSES_ITS_PEER = """
    import os, pathlib, signal, sys, time
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    while not pathlib.Path(sys.argv[1]).exists():
        time.sleep(0.01)
    print("rank 0: connection closed by peer (rank 1)", flush=True)
    sys.exit(1)
"""


def test_of_two_ranks_failed_when_the_supervisor_looks_the_first_to_fail_is_named(tmp_path):
    """Rank 1 is killed, then rank 0 fails because its peer is gone, both before the supervisor looks: rank 1 is the
    cause, though rank 0 has the lower rank and exited last. The order is made certain by a handshake, not by
    timing: rank 0 fails only once the supervisor has seen rank 1 end."""
    peer_gone = tmp_path / "peer-gone"
    group = start_group(tmp_path, LOSES_ITS_PEER, str(peer_gone), world_size=2)
    wait_until(lambda: group.exits == [(1, -signal.SIGKILL)], what="rank 1's end")
    peer_gone.touch()
    wait_until(lambda: len(group.exits) == 2, what="rank 0's end")
    assert group.wait() == GroupExit(failed_rank=1, code=-signal.SIGKILL)
    assert group.exits == [(1, -signal.SIGKILL), (0, 1)]


LAST_WORDS = """
    import os, signal
    print("loading", flush=True)
    print("rank 0 is going down", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_tail_of_a_failed_ranks_log_holds_what_it_wrote_last_however_late_its_output_is_copied(tmp_path):
    """Under `echo` (a pod of several ranks) a thread copies each rank's output from its pipe to its log, and the
    group's wait returns as soon as the rank has exited: the copy may lag behind (a clean clone's run on a busy
    machine lost the last line from a pod's termination message). The copy is held here, line two not yet in the
    log when the wait returns (the copier writes each line to the log, then echoes it under the echo lock, held by
    the test); the tail, read then, waits for the pipe to be drained."""
    contracts = [WorkerContract.local(0, 1, job="group")]
    group = LocalGroup([sys.executable, "-c", textwrap.dedent(LAST_WORDS)], contracts, environ={},
                       log_dir=tmp_path / "logs", echo=True)
    with group._echo_lock:
        group.start()
        assert group.wait() == GroupExit(failed_rank=0, code=-signal.SIGKILL)
        wait_until(lambda: "loading" in group.logs[0].read_text(), what="the first line copied")
        assert "going down" not in group.logs[0].read_text(), "the copy is held"
        threading.Timer(0.3, group._echo_lock.release).start()
        tail = group.tail(0)
        group._echo_lock.acquire()
    assert tail.splitlines() == ["loading", "rank 0 is going down"]
