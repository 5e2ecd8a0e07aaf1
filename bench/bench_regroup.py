"""Elastic recovery (issue 38): what losing a rank costs a job with `spec.elastic.recovery: regroup` (the survivor
trains on alone, the replacement joins it) against `recovery: restart` (the whole group restarts from its latest
checkpoint), side by side in one run.

    .venv/bin/python bench/bench_regroup.py              # 3 rounds, rank 1 lost
    .venv/bin/python bench/bench_regroup.py --rounds 1
    .venv/bin/python bench/bench_regroup.py --lose 0     # rank 0 lost (the status and checkpoints' rank)

One emulated cluster (devcluster/: the API emulator, and the test kubelet running each pod as a local process) and
`tandem operator --restart-backoff-seconds 0`. Each round runs one job of each recovery (the order flips each
round): 2 ranks, `elastic: {minWorkers: 1}`, the digits MLP (bench/regroup_model.py) on tandem.examples.digits
data, batchSizePerWorker 16, a checkpoint every 50 steps on a claim (so that a restart resumes from one). The model
appends a line to the job's forward log at every training forward: the time, its process, its RANK, the examples of
the micro-batch and the ranks of its process group. Once the job has recorded a checkpoint and trained for 10 s,
the lost rank's pod process (rank 1's; `--lose 0`: rank 0's) gets SIGKILL (t0); once a new process of that rank
trains, 5 s more are logged, then the job is deleted. The other rank is the survivor. From the forward log:

- advancing again: seconds from t0 to the first forward of a process group formed after the loss (the survivor's
  own process in a group of 1 after a regroup; a new process after a restart). For a regroup, the survivor's
  `regrouped: generation 2 ... in X s` line is shown too (from its noticing the loss to the new group).
- full size again: seconds from t0 to the first forward of a new process of the lost rank.
- steps done again: the steps the survivor's first process began before the new group's first forward (its
  forwards: one a step at 2 ranks), less the step training resumed at (a regroup: its log line's; a restart: the
  checkpoint's, status.lastRecovery.resumedAtStep). The step in flight at the loss is among them: a regroup
  abandons it.
- survivor restarted: whether the survivor's pod process changed (cluster.kubelet.pid).
- samples/s, over every process's forwards: the 5 s before t0, from advancing again to full size again (shown
  when that lasts 0.5 s or more), and the 5 s after full size again.

Emulated: pods are local processes on this machine, sharing its cores with one another (each rank's torch sizes its
threads to all of them), the operator and the API emulator; no image pull, no scheduling latency, warm page caches
(torch's import is a new process's main start-up cost). Other load on the machine moves every figure, samples/s
most: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from operator_runs import GROUP, JOBS, NS, VERSION, claim, job_pods, start_operator  # noqa: E402

from devcluster import Cluster  # noqa: E402

RECOVERIES = ("regroup", "restart")
CLAIM = "regroup-bench"
WORKERS, BATCH_SIZE, EVERY_STEPS, EPOCHS = 2, 16, 50, 2000  # epochs: far more than a measurement lasts
TRAINED_BEFORE_KILL = 10.0  # seconds of forwards before a rank is killed
WINDOW = 5.0  # seconds of the throughput windows before the kill and after full size again
SHORTEST_WINDOW = 0.5  # seconds: a shorter window's throughput is not shown (a restart's reduced size: milliseconds)
WAIT = 180.0
POLL = 0.5  # seconds between looks at the API and the forward log (the benchmark's own load kept light)
REGROUPED = (r"regrouped: generation 2, 1 rank\(s\) \(lost rank\(s\) {lost}\), stopped at step (\d+), "
             r"resumed at step (\d+) in ([\d.]+)s")


@dataclass(frozen=True)
class Forward:
    time: float
    pid: int
    rank: int
    examples: int
    ranks: int


def forwards(log: Path) -> list[Forward]:
    """The forward log's complete lines, in the order written (a process's lines are in time order)."""
    text = log.read_text() if log.exists() else ""
    lines = text.splitlines()
    if not text.endswith("\n"):  # a line being written
        lines = lines[:-1]
    return sorted((Forward(float(t), int(pid), int(rank), int(examples), int(ranks))
                   for t, pid, rank, examples, ranks in (line.split() for line in lines)), key=lambda f: f.time)


def first_forward_time(log: Path) -> float | None:
    """When the first forward ran (None before one did), reading the log's first line alone."""
    if not log.exists():
        return None
    with log.open() as lines:
        first = lines.readline()
    return float(first.split()[0]) if first.endswith("\n") else None


def elastic_job(name: str, recovery: str, log: Path) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": name},
            "spec": {"workers": WORKERS, "elastic": {"minWorkers": 1, "recovery": recovery},
                     "trainer": {"model": "regroup_model:forward_logged_mlp", "modelArgs": {"log": str(log)},
                                 "data": "tandem.examples.digits:train_data", "epochs": EPOCHS,
                                 "batchSizePerWorker": BATCH_SIZE},
                     "checkpoint": {"persistentVolumeClaim": CLAIM, "directory": f"runs/{name}/checkpoints",
                                    "everySteps": EVERY_STEPS}}}


def status(cluster: Cluster, name: str) -> dict:
    return (cluster.get("ptj", NS, name) or {}).get("status") or {}


def samples_per_second(logged: list[Forward], start: float, end: float) -> float | None:
    if end - start < SHORTEST_WINDOW:
        return None
    return sum(f.examples for f in logged if start <= f.time < end) / (end - start)


@dataclass
class Loss:
    """What losing a rank cost one job."""

    advancing_again: float
    full_size_again: float
    steps_begun: int
    resumed_at: int
    survivor_restarted: bool
    samples_before: float | None
    samples_reduced: float | None
    samples_after: float | None
    regrouped_line: str = ""
    """The survivor's `regrouped: generation 2 ...` (a regroup)."""
    regrouped_in: float | None = None
    """Its `in X s`: from the survivor noticing the loss to the new group formed."""

    @property
    def steps_done_again(self) -> int:
        return self.steps_begun - self.resumed_at


def lose_rank(cluster: Cluster, directory: Path, recovery: str, lost: int) -> Loss:
    name = f"{recovery}-{uuid.uuid4().hex[:6]}"
    log = directory / f"{name}.forwards"
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, elastic_job(name, recovery, log))
    cluster.wait_for(lambda: status(cluster, name).get("checkpoint", {}).get("latest"), WAIT,
                     "the job to record a checkpoint", interval=POLL)
    cluster.wait_for(lambda: (began := first_forward_time(log)) and time.time() - began >= TRAINED_BEFORE_KILL,
                     WAIT, "the job to train a while", interval=POLL)
    survivor = 1 - lost
    survivor_pid = cluster.kubelet.pid(NS, f"{name}-worker-{survivor}")
    lost_pid = cluster.kubelet.pid(NS, f"{name}-worker-{lost}")
    killed_at = time.time()
    cluster.kubelet.kill(NS, f"{name}-worker-{lost}")

    def new_lost_rank_forward() -> Forward | None:
        return next((f for f in forwards(log) if f.rank == lost and f.pid != lost_pid and f.time > killed_at), None)

    full_size = cluster.wait_for(new_lost_rank_forward, WAIT, f"a new rank {lost} process to train", interval=POLL)
    time.sleep(WINDOW)
    logged = forwards(log)
    survivor_after = cluster.kubelet.pid(NS, f"{name}-worker-{survivor}")
    survivor_log = cluster.logs(NS, f"{name}-worker-{survivor}")
    resumed_at = status(cluster, name).get("lastRecovery", {}).get("resumedAtStep")
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, JOBS, name)
    cluster.wait_for(lambda: not job_pods(cluster, name), WAIT, f"{name}'s pods to go")

    first_pids = {survivor_pid, lost_pid}
    assert {f.pid for f in logged if f.time < killed_at} == first_pids, "the pods' processes are the ones training"
    advancing = next(f for f in logged if f.time > killed_at and (f.pid not in first_pids or f.ranks < WORKERS))
    steps_begun = sum(1 for f in logged if f.pid == survivor_pid and f.time < advancing.time)
    regrouped = re.search(REGROUPED.format(lost=lost), survivor_log)
    if recovery == "regroup":
        assert regrouped, f"the survivor logged its regroup:\n{survivor_log[-3000:]}"
        resumed_at = int(regrouped.group(2))
    return Loss(advancing_again=advancing.time - killed_at, full_size_again=full_size.time - killed_at,
                steps_begun=steps_begun, resumed_at=resumed_at, survivor_restarted=survivor_after != survivor_pid,
                samples_before=samples_per_second(logged, killed_at - WINDOW, killed_at),
                samples_reduced=samples_per_second(logged, advancing.time, full_size.time),
                samples_after=samples_per_second(logged, full_size.time, full_size.time + WINDOW),
                regrouped_line=regrouped.group(0) if regrouped else "",
                regrouped_in=float(regrouped.group(3)) if regrouped else None)


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def print_round(number: int, losses: dict[str, Loss]) -> None:
    print(f"\nround {number}:")
    print("| recovery | advancing again | full size again | steps begun, resumed at, done again | survivor restarted "
          "| samples/s before, reduced, after |")
    print("|---|---|---|---|---|---|")
    for recovery, loss in losses.items():
        print(f"| {recovery} | {loss.advancing_again:.2f} s | {loss.full_size_again:.2f} s | {loss.steps_begun}, "
              f"{loss.resumed_at}, {loss.steps_done_again} | {'yes' if loss.survivor_restarted else 'no'} | "
              f"{rate(loss.samples_before)}, {rate(loss.samples_reduced)}, {rate(loss.samples_after)} |")
    if losses["regroup"].regrouped_line:
        print(f"survivor (regroup): {losses['regroup'].regrouped_line}")


def median(losses: list[Loss], measure: str) -> float | None:
    values = [value for loss in losses if (value := getattr(loss, measure)) is not None]
    return statistics.median(values) if values else None


def print_summary(found: dict[str, list[Loss]], rounds: int, lost: int) -> None:
    print(f"\nMedians of {rounds} round(s), rank {lost} lost:")
    print("| measure | regroup | restart | restart / regroup |")
    print("|---|---|---|---|")
    for measure, unit in (("advancing_again", "s"), ("full_size_again", "s"), ("steps_done_again", "steps")):
        regroup, restart = median(found["regroup"], measure), median(found["restart"], measure)
        ratio = f"{restart / regroup:.1f}x" if regroup else "-"
        print(f"| {measure.replace('_', ' ')} | {regroup:.2f} {unit} | {restart:.2f} {unit} | {ratio} |")
    print(f"| the survivor's log: regrouped in | {median(found['regroup'], 'regrouped_in'):.2f} s | | |")
    for measure, label in (("samples_before", "samples/s before the kill"),
                           ("samples_reduced", "samples/s at the reduced size"),
                           ("samples_after", "samples/s at full size again")):
        print(f"| {label} | {rate(median(found['regroup'], measure))} | {rate(median(found['restart'], measure))} "
              "| |")
    restarted = {recovery: sum(loss.survivor_restarted for loss in found[recovery]) for recovery in RECOVERIES}
    print(f"| survivor restarted | {restarted['regroup']} of {rounds} | {restarted['restart']} of {rounds} | |")
    regroups = found["regroup"]
    goals = [("advancing again <= 3 s after the kill", median(regroups, "advancing_again") <= 3),
             ("full size again <= 10 s after the kill", median(regroups, "full_size_again") <= 10),
             ("steps lost <= 1 (the step in flight)", median(regroups, "steps_done_again") <= 1),
             ("no survivor restarted", restarted["regroup"] == 0)]
    print("\nIssue 38's goals for regroup (medians):")
    for goal, met in goals:
        print(f"- {goal}: {'met' if met else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lose", type=int, choices=(0, 1), default=1, help="the rank whose pod is killed")
    args = parser.parse_args()
    found: dict[str, list[Loss]] = {recovery: [] for recovery in RECOVERIES}
    with tempfile.TemporaryDirectory() as directory, \
            Cluster(Path(directory) / "cluster", extra_env={"PYTHONPATH": str(BENCH)}) as cluster:
        start_operator(cluster)
        claim(cluster, CLAIM)
        for round_ in range(args.rounds):
            losses = {}
            for recovery in RECOVERIES if round_ % 2 == 0 else RECOVERIES[::-1]:
                losses[recovery] = lose_rank(cluster, Path(directory), recovery, args.lose)
                found[recovery].append(losses[recovery])
            print_round(round_ + 1, losses)
    print_summary(found, args.rounds, args.lose)


if __name__ == "__main__":
    main()
