"""One machine's ranks as one group: a process per rank, started with its worker contract, watched until they end,
stopped together. `tandem run` starts a whole job's ranks this way (tandem/backends/local_ranks.py), and a pod
hosting several ranks starts its own (`tandem worker launch`, tandem.worker.train.launch): one supervisor, so the
ranks start, fail and stop the same way on a laptop and in a pod.

Each rank's output goes to its log file, and with `echo` to this process's stdout too, each line prefixed with the
rank (a pod's log is its ranks' logs together). The kernel signals every rank when the supervisor dies
(PR_SET_PDEATHSIG), so none outlives it.

This module imports neither torch nor either half of the worker: a pod's launcher needs neither.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tandem.api import ParallelTrainingJobSpec
from tandem.contract import GROUP_RESTART_EXIT_CODE, PERMANENT_FAILURE_EXIT_CODE, WorkerContract

TRAIN_COMMAND = [sys.executable, "-m", "tandem.worker", "train"]
COORDINATOR_COMMAND = [sys.executable, "-m", "tandem.worker", "coordinator"]
POLL_SECONDS = 0.2
LOG_TAIL_LINES = 30
OUTPUT_DRAIN_SECONDS = 5.0
"""How long `tail` waits for an exited rank's last output to be copied from its pipe to its log (a process it
started that outlives it and holds the pipe open would keep the pipe from ending)."""
_PR_SET_PDEATHSIG = 1


def _on_parent_death(sig: int) -> Callable[[], None]:
    def arrange() -> None:
        """Runs in each child before exec: the kernel sends it `sig` if the supervisor dies (Linux)."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)

    return arrange


def rank_command(spec: ParallelTrainingJobSpec) -> list[str]:
    """What each rank runs: Tandem's trainer (`tandem worker train`), or the custom command."""
    return [*spec.custom.command, *spec.custom.args] if spec.training_mode == "custom" else TRAIN_COMMAND


@dataclass(frozen=True)
class GroupExit:
    """How a group ended: every rank exited 0 (failed_rank None), or the first rank seen failing and its code."""

    failed_rank: int | None = None
    code: int = 0
    local_rank: int | None = None

    @property
    def cause(self) -> str:
        """The failure in the restart policy's words; the local rank too where the machine hosts several."""
        how = f"exited with code {self.code}"
        if self.code < 0:
            how += f" (killed by {signal.Signals(-self.code).name})"
        where = f" (local rank {self.local_rank})" if self.local_rank is not None else ""
        return f"rank {self.failed_rank}{where} {how}"


class LocalGroup:
    """The ranks of `contracts`, each running `command` in `environ` plus its contract, logged to `log_dir`.

    `own_sessions`: each rank in a session of its own, so that stopping it reaches whatever it started and a
    terminal's Ctrl-C reaches only the supervisor (`tandem run`); in a pod the ranks stay in the supervisor's process
    group, so a kill of the container's group reaches them. `parent_death_signal`: what a rank gets if the
    supervisor dies (SIGTERM: it checkpoints; SIGKILL in a pod, whose container is going)."""

    def __init__(self, command: list[str], contracts: list[WorkerContract], *, environ: Mapping[str, str],
                 log_dir: Path, echo: bool = False, own_sessions: bool = True,
                 parent_death_signal: int = signal.SIGTERM, grace_seconds: float | None = 30.0,
                 coordinator: Mapping[str, str] | None = None):
        self.command = command
        self.contracts = contracts
        self.environ = dict(environ)
        self.log_dir = log_dir
        self.echo = echo
        self.own_sessions = own_sessions
        self.parent_death_signal = parent_death_signal
        self.grace_seconds = grace_seconds
        """From a stop to killing the ranks still running; None: no limit (a pod's kubelet keeps its own)."""
        self.processes: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self._copiers: dict[int, threading.Thread] = {}
        """Per index in `contracts`, the thread copying its (latest) process's output to its log, under `echo`."""
        self.stopping_since: float | None = None
        self.exits: list[tuple[int, int]] = []
        """(index in `contracts`, exit code) in the order the ranks exited: the first to fail is the cause, not the
        ranks that failed because it did (a rank whose peer is gone fails too, often within the same poll)."""
        self.coordinator_environ = coordinator
        """An elastic job's (spec.elastic, recovery regroup): its coordinator's contract (MASTER_PORT, WORLD_SIZE,
        TANDEM_SPEC), started before the ranks (worker/train/coordinator.py: the job's store and planner). A rank that
        fails is then replaced by a new process in its place, which joins the survivors' group, unless it says the
        group must restart (GROUP_RESTART_EXIT_CODE) or its failure is permanent; the coordinator's exit 0 ends the
        training."""
        self.coordinator: subprocess.Popen | None = None
        self.replaced: list[tuple[int, int]] = []
        """(index in `contracts`, exit code) of each rank replaced, in order."""
        self._replaceable: list[tuple[int, int]] = []
        self._ending = False
        self._echo_lock = threading.Lock()
        self._exited = threading.Event()
        """Set when a rank exits: `wait` reacts at once, before the failed rank's peers fail in their turn."""

    @property
    def replaces_lost(self) -> bool:
        return self.coordinator_environ is not None

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.coordinator_environ is not None:
            with open(self.log_dir / "coordinator.log", "wb") as output:
                self.coordinator = subprocess.Popen(
                    COORDINATOR_COMMAND, env={**self.environ, **self.coordinator_environ}, stdout=output,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=self.own_sessions,
                    preexec_fn=_on_parent_death(signal.SIGKILL))
        for index, contract in enumerate(self.contracts):
            self.logs.append(self.log_dir / f"rank-{contract.rank}.log")
            self.processes.append(self._launch(index, mode="wb"))

    def _launch(self, index: int, *, mode: str) -> subprocess.Popen:
        """Start the rank of `contracts[index]`, its log opened with `mode` (a replacement appends)."""
        contract, log = self.contracts[index], self.logs[index]
        with open(log, mode) as output:
            process = subprocess.Popen(
                self.command, env={**self.environ, **contract.to_environ()},
                stdout=subprocess.PIPE if self.echo else output, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=self.own_sessions,
                preexec_fn=_on_parent_death(self.parent_death_signal),
            )
        if self.echo:
            self._copiers[index] = threading.Thread(target=self._copy_output, args=(contract.rank, process, log),
                                                    name=f"tandem-rank-{contract.rank}-output", daemon=True)
            self._copiers[index].start()
        threading.Thread(target=self._watch, args=(index, process), name=f"tandem-rank-{contract.rank}",
                         daemon=True).start()
        return process

    def _copy_output(self, rank: int, process: subprocess.Popen, log: Path) -> None:
        """A rank's lines to its log and, prefixed with the rank where there are several, to stdout."""
        prefix = f"[rank {rank}] ".encode() if len(self.contracts) > 1 else b""
        with open(log, "ab") as output:
            for line in process.stdout:
                output.write(line)
                output.flush()
                with self._echo_lock:
                    sys.stdout.buffer.write(prefix + line)
                    sys.stdout.buffer.flush()

    def _watch(self, index: int, process: subprocess.Popen) -> None:
        code = process.wait()
        replaceable = self.replaces_lost and code not in (0, GROUP_RESTART_EXIT_CODE, PERMANENT_FAILURE_EXIT_CODE)
        (self._replaceable if replaceable else self.exits).append((index, code))
        self._exited.set()

    def _replace_lost(self) -> None:
        """Replace the ranks lost since the last look (`replaces_lost`), unless the group is ending (then they are
        exits). From the supervisor's own thread, `wait`'s: a child's parent-death signal fires when the thread that
        started it ends."""
        while self._replaceable:
            index, code = self._replaceable.pop(0)
            if self.stopping_since is None and not self._ending and not self.exits and self.coordinator.poll() is None:
                self.replaced.append((index, code))
                self.processes[index] = self._launch(index, mode="ab")
            else:
                self.exits.append((index, code))

    def stop(self) -> None:
        """Ask every rank to stop (SIGTERM: they agree on a step and write a final checkpoint); `wait` kills them
        once the grace period is over."""
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
            self._terminate_running()

    def _terminate_running(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)

    def kill_all(self) -> None:
        """SIGKILL to each rank (to its whole session, where it has one) and the coordinator, then reap them."""
        self._ending = True
        everyone = [*self.processes, *([self.coordinator] if self.coordinator is not None else [])]
        for process in everyone:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the rank and all it started are gone
                if self.own_sessions:
                    os.killpg(process.pid, signal.SIGKILL)
                elif process.poll() is None:
                    process.kill()
        for process in everyone:
            process.wait()

    def wait(self, *, on_poll: Callable[[], None] = lambda: None,
             past_deadline: Callable[[], bool] = lambda: False) -> GroupExit:
        """Until every rank has exited, or one fails (the others are killed at once: the group restarts as a
        whole). Calls `on_poll` between looks; past the deadline, stops the group."""
        while True:
            on_poll()
            self._replace_lost()
            exits = list(self.exits)
            failed = [(index, code) for index, code in exits if code != 0]
            if self.replaces_lost and (self.coordinator.poll() == 0 or any(code == 0 for _, code in exits)):
                # An elastic job's training is over (the coordinator ends once the ranks mark it finished; a rank
                # exits 0 only after): the others are done, or are ranks woken too late and replacements that have
                # nothing to join (stopped).
                failed = []
                if not self._ending:
                    self._ending = True
                    self._terminate_running()
            if failed and self.stopping_since is None:
                self.kill_all()
                on_poll()
                return self._exit(*failed[0])
            if len(exits) == len(self.processes):
                on_poll()
                return self._exit(*failed[0]) if failed else GroupExit()
            if self.stopping_since is None and past_deadline():
                self.stop()
            if (self.stopping_since is not None and self.grace_seconds is not None
                    and time.monotonic() - self.stopping_since > self.grace_seconds):
                self.kill_all()
                on_poll()
                return GroupExit()
            self._exited.wait(POLL_SECONDS)
            self._exited.clear()

    def _exit(self, index: int, code: int) -> GroupExit:
        contract = self.contracts[index]
        several = contract.local_world_size < contract.world_size
        return GroupExit(contract.rank, code, contract.local_rank if several else None)

    def tail(self, rank: int, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of `rank`'s log: once its process has exited, with what it wrote last (its pipe drained)."""
        index = next(i for i, contract in enumerate(self.contracts) if contract.rank == rank)
        if index in self._copiers and self.processes[index].poll() is not None:
            self._copiers[index].join(OUTPUT_DRAIN_SECONDS)
        return "\n".join(self.logs[index].read_text(errors="replace").splitlines()[-lines:])
