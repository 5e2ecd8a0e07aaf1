"""Preemption that costs no work (issue 19): what a training job loses when Kueue preempts it, against what it loses
when its pods are killed, or when one of them is deleted by hand, in one run, side by side.

Every round starts a fresh emulated cluster (devcluster/: the API emulator, the test kubelet that runs each pod as a
local process, and devcluster's *emulation* of Kueue's admission, devcluster/kueue.py: a ClusterQueue's quota,
priorities, preemption within the ClusterQueue and the Workload's conditions; not Kueue itself) with a real `tandem
operator --kueue --restart-backoff-seconds 0`, a ResourceFlavor, a ClusterQueue of 2 CPUs that preempts lower
priorities, a LocalQueue and two WorkloadPriorityClasses (low 10, high 1000), as tests/integration/test_kueue.py.
Then, one after another in an order that rotates from round to round, the same ParallelTrainingJob in three
scenarios. The job: 2 ranks of 1 CPU each (the whole quota), real gloo processes; bench/preemption_model.py's digits
MLP with dropout (hidden 32, p 0.3), a pause of `--step-seconds` (0.05) in each training forward, batch 16 per rank,
SGD (lr 0.05, momentum 0.9), `deterministic: true`, no eval data, `maxSteps` 240, a checkpoint every `--every` (50)
steps on a PersistentVolumeClaim. Rank 0 appends a line to a file per training forward it has computed.

Each scenario waits until rank 0 has computed step `--base` + offset (the offset drawn per round from the middle
three fifths of the interval, `--seed`; the same for the three scenarios of a round) and reported the checkpoint of
step `--base` (100) in the job's status, then:

- kueue: the job is labelled for the LocalQueue (priority low). A job of priority high asking the same quota is
  created (custom mode: 2 ranks that sleep `--preemptor-seconds`, 1 s, and exit 0). The emulated Kueue evicts the
  first job's Workload (Preempted); the operator stops the group as a suspension does (its pods deleted with their
  grace period: SIGTERM, the ranks agree on a step, checkpoint there and exit), gives the quota back once every pod
  is gone (the Workload's admission cleared), the preemptor is admitted, runs and finishes, and the first job is
  admitted again and resumes from the checkpoint of the agreed step. Expected: restarts 0, evictions 1.
- killed: no queue. Both rank pods are deleted with gracePeriodSeconds=0 (what a job loses when its pods are evicted
  without a grace period, or its node dies: e.g. a KubeRay or Volcano job gang-evicted). The test kubelet SIGKILLs
  their processes at once; the operator restarts the group from the latest checkpoint (status.checkpoint.latest: the
  periodic one). Expected: restarts 1.
- deleted: no queue. Rank 1's pod is deleted with its default grace period (`kubectl delete pod`; the pods'
  terminationGracePeriodSeconds is 60): SIGTERM. The operator counts a failure, deletes the other pod, and restarts
  the group from the latest checkpoint. Expected: restarts 1.

Measured, per scenario and round:

- steps lost: the lines rank 0 wrote (one per training forward, over every group of the job), less maxSteps: the
  steps the job computed that a later group computed again. Exact: no eval forward, one forward per step. A forward
  under way when its process is SIGKILLed is not counted; one finished whose step was not (its backward, its
  all-reduce) is. Also shown: the step rank 0 had computed at the eviction (for kueue: at Kueue's decision, as
  recorded in `cluster.kueue.history`; otherwise at the delete call), the periodic checkpoint then, and the step the
  resumed group started from (maxSteps less the last group's forwards).
- to every rank pod gone: seconds from the eviction (kueue: the emulated Kueue's record of its preemption of the
  Workload, `history`, the same moment its Evicted condition is written; otherwise the first delete call) until no
  pod of the stopped group is left in the API (polled every 20 ms; on a cluster this is when its GPUs are
  released: there are no GPUs here, "GPU released" means the pod is gone); split at the moment every one of them
  was marked for deletion (deletionTimestamp set: the operator's reaction, for kueue and for the other pod of
  deleted) and the rest (the ranks' own stop: agreeing on a step, the checkpoint, the exit, the kubelet's report);
- kueue only: to quota given back (the emulated Kueue's record that the Workload no longer holds quota: the operator
  cleared its admission) and to preemptor admitted (its record of the preemptor's Workload admitted); the seconds
  from creating the preemptor to the eviction are printed too (the operator creates its Workload, Kueue decides);
- to training again: seconds from the eviction until rank 0 of a new group has computed a forward (for kueue this
  includes the preemptor's whole run).

    .venv/bin/python bench/bench_preemption.py                  # 3 rounds; about 5 minutes on 2 quiet cores
    .venv/bin/python bench/bench_preemption.py --rounds 5 --only kueue --only killed

Printed: each scenario's median and each round's figure, the difference of the steps lost (killed less kueue; a
ratio is infinite when kueue loses none), and the ratio of the seconds to every rank pod gone, kueue over deleted.
The operator restarts a group with no backoff here (`--restart-backoff-seconds 0`); the timings are the emulated
cluster's (one process serves the API, the kubelet and Kueue's emulation on 2 shared cores), not a real cluster's.
Exits 1 if a job did not end Succeeded at step maxSteps with the expected restarts and evictions.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from devcluster import Cluster  # noqa: E402
from devcluster.kueue import one_queue  # noqa: E402
from devcluster.network import free_port  # noqa: E402

GROUP, VERSION, NS, JOBS = "tandem.dev", "v1alpha1", "default", "paralleltrainingjobs"
QUEUE_LABEL, PRIORITY_LABEL = "kueue.x-k8s.io/queue-name", "kueue.x-k8s.io/priority-class"  # tandem.operator.queueing
JOB_LABEL = "tandem.dev/job"
FLAVOR_LABEL = {"tandem.dev/node-pool": "cpu"}
SCENARIOS = ("kueue", "killed", "deleted")
TITLES = {"kueue": "Kueue preemption (cooperative)", "killed": "pods killed (grace 0)",
          "deleted": "plain pod deletion (rank 1)"}
EXPECTED = {"kueue": (0, 1), "killed": (1, 0), "deleted": (1, 0)}  # restarts, evictions
MAX_STEPS = 240


# -- the cluster and its objects ----------------------------------------------------------------------------------
def training_job(name: str, log: Path, args: argparse.Namespace) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": name},
            "spec": {"workers": 2, "resources": {"requests": {"cpu": "1"}},
                     "trainer": {"model": "preemption_model:counted_mlp",
                                 "modelArgs": {"hidden": 32, "dropout": 0.3, "step_seconds": args.step_seconds,
                                               "log": str(log)},
                                 "data": "tandem.examples.digits:train_data", "evalData": None,
                                 "batchSizePerWorker": 16, "deterministic": True, "epochs": 100,
                                 "maxSteps": MAX_STEPS, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
                     "checkpoint": {"persistentVolumeClaim": name, "directory": "checkpoints",
                                    "everySteps": args.every}}}


def preemptor_job(name: str, seconds: float) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": name},
            "spec": {"workers": 2, "resources": {"requests": {"cpu": "1"}}, "trainingMode": "custom",
                     "custom": {"command": ["python", "-c", f"import time; time.sleep({seconds})"]},
                     "trainer": {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data"}}}


def queued(document: dict, priority: str) -> dict:
    document["metadata"]["labels"] = {QUEUE_LABEL: "team-a", PRIORITY_LABEL: priority}
    return document


def claim(cluster: Cluster, name: str) -> None:
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
                   "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})


def create(cluster: Cluster, document: dict) -> None:
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, document)


def status(cluster: Cluster, name: str) -> dict:
    return (cluster.get(f"{GROUP}/{VERSION}/{JOBS}", NS, name) or {}).get("status") or {}


def job_pods(cluster: Cluster, name: str) -> list[dict]:
    return sorted((p for p in cluster.list("pods", NS) if (p["metadata"].get("labels") or {}).get(JOB_LABEL) == name),
                  key=lambda p: p["metadata"]["name"])


def workload_of(cluster: Cluster, name: str) -> str | None:
    return next((w["metadata"]["name"] for w in cluster.list("workloads", NS)
                 if (w["metadata"].get("labels") or {}).get(JOB_LABEL) == name), None)


def kueue_record(cluster: Cluster, event: str, workload: str | None, after: float) -> float | None:
    """When the emulated Kueue first recorded `event` for the Workload at or after `after` (time.time())."""
    return next((at for at, what, key in list(cluster.kueue.history)
                 if what == event and key == f"{NS}/{workload}" and at >= after), None)


def start_operator(cluster: Cluster) -> None:
    cluster.spawn([sys.executable, "-m", "tandem.cli", "operator", "--namespace", NS, "--restart-backoff-seconds",
                   "0", "--worker-image", "tandem-worker:test", "--metrics-port", str(free_port()), "--kueue"],
                  name="operator", cwd=ROOT, client="operator")
    wanted = {JOBS, "pods", "workloads"}

    def watching() -> bool:
        watched = {request.resource.plural for request in list(cluster.emulator)
                   if request.params.get("watch") and request.resource is not None
                   and cluster.emulator.client_of(request) == "operator"}
        return wanted <= watched

    wait(cluster, watching, 60, "the operator's watches", interval=0.1)


def wait(cluster: Cluster, check, timeout: float, what: str, interval: float = 0.05):
    try:
        return cluster.wait_for(check, timeout, what, interval=interval)
    except TimeoutError:
        print(cluster.process_log("operator")[-3000:], file=sys.stderr)
        raise


def forwards(log: Path) -> list[tuple[float, int]]:
    """(time, pid) of each training forward rank 0 computed, in order."""
    try:
        text = log.read_text()
    except FileNotFoundError:
        return []
    lines = [line.split() for line in text.splitlines()]
    return [(float(at), int(pid)) for at, pid in (line for line in lines if len(line) == 2)]


# -- one scenario -------------------------------------------------------------------------------------------------
@dataclass
class Result:
    lost: float = float("nan")  # steps computed twice
    at_eviction: int | None = None  # the step rank 0 had computed at the eviction
    checkpoint: int | None = None  # the periodic checkpoint reported then
    resumed_from: int | None = None  # the step the last group started from
    groups: list[int] = field(default_factory=list)  # forwards of each group (rank 0's processes)
    gone: float = float("nan")  # seconds from the eviction to every rank pod of the stopped group gone
    marked: float = float("nan")  # ... to every one of them marked for deletion (the rest is the ranks' stopping)
    quota: float = float("nan")  # kueue: to the quota given back
    admitted: float = float("nan")  # kueue: to the preemptor admitted
    decided: float = float("nan")  # kueue: from creating the preemptor to the eviction
    again: float = float("nan")  # to a new group's first forward
    restarts: int | None = None
    evictions: int | None = None
    problems: list[str] = field(default_factory=list)


def run_scenario(cluster: Cluster, scenario: str, name: str, offset: int, args: argparse.Namespace,
                 scratch: Path) -> Result:
    log = scratch / f"{name}.forwards"
    claim(cluster, name)
    job = training_job(name, log, args)
    create(cluster, queued(job, "low") if scenario == "kueue" else job)
    target = args.base + offset

    def due() -> bool:
        reported = status(cluster, name).get("checkpoint", {}).get("step") or 0
        return len(forwards(log)) >= target and reported >= args.base and len(job_pods(cluster, name)) == 2

    wait(cluster, due, args.timeout, f"{name} to compute step {target}", interval=0.02)
    pods = job_pods(cluster, name)
    stopped = {p["metadata"]["uid"] for p in pods}
    result = Result(checkpoint=status(cluster, name).get("checkpoint", {}).get("step"))
    preemptor = f"urgent-{name}"
    delete_at = time.time()
    if scenario == "kueue":
        create(cluster, queued(preemptor_job(preemptor, args.preemptor_seconds), "high"))
    elif scenario == "killed":
        for pod in pods:
            cluster.core.delete_namespaced_pod(pod["metadata"]["name"], NS, grace_period_seconds=0)
    else:
        cluster.core.delete_namespaced_pod(pods[1]["metadata"]["name"], NS)

    marked_at = None  # when every pod of the stopped group was marked for deletion (or gone)

    def all_gone() -> float | None:
        nonlocal marked_at
        left = [p for p in job_pods(cluster, name) if p["metadata"]["uid"] in stopped]
        if marked_at is None and all(p["metadata"].get("deletionTimestamp") for p in left):
            marked_at = time.time()
        return None if left else time.time()

    gone_at = wait(cluster, all_gone, args.timeout, f"{name}'s stopped pods to go", interval=0.02)
    final = wait(cluster, lambda: (s := status(cluster, name)).get("phase") in ("Succeeded", "Failed") and s,
                 args.timeout, f"{name} to finish", interval=0.2)

    evicted_at = delete_at
    if scenario == "kueue":
        workload = workload_of(cluster, name)
        evicted_at = kueue_record(cluster, "preempted", workload, delete_at)
        if evicted_at is None:
            result.problems.append(f"{name}: no preemption of its Workload {workload} recorded")
            evicted_at = delete_at
        result.decided = evicted_at - delete_at
        released = kueue_record(cluster, "released", workload, evicted_at)
        admitted = kueue_record(cluster, "admitted", workload_of(cluster, preemptor), evicted_at)
        result.quota = released - evicted_at if released is not None else float("nan")
        result.admitted = admitted - evicted_at if admitted is not None else float("nan")
    lines = forwards(log)
    result.at_eviction = sum(1 for at, _ in lines if at <= evicted_at)
    result.gone, result.marked = gone_at - evicted_at, marked_at - evicted_at
    old = {pid for at, pid in lines if at <= evicted_at}
    result.again = next((at - evicted_at for at, pid in lines if pid not in old and at > evicted_at), float("nan"))
    result.groups = [len(list(group)) for _, group in itertools.groupby(pid for _, pid in lines)]
    result.lost = len(lines) - MAX_STEPS
    result.resumed_from = MAX_STEPS - result.groups[-1] if len(result.groups) > 1 else None
    result.restarts, result.evictions = final.get("restarts") or 0, (final.get("queue") or {}).get("evictions") or 0
    step = (final.get("progress") or {}).get("step")
    if final.get("phase") != "Succeeded" or step != MAX_STEPS \
            or (result.restarts, result.evictions) != EXPECTED[scenario]:
        result.problems.append(f"{name}: {final.get('phase')} at step {step}, restarts {result.restarts}, evictions "
                               f"{result.evictions} (want Succeeded at {MAX_STEPS}, restarts and evictions "
                               f"{EXPECTED[scenario]}): {final.get('message')}")
    for job_name in (name, preemptor) if scenario == "kueue" else (name,):
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, JOBS, job_name)
    wait(cluster, lambda: not job_pods(cluster, name) and not job_pods(cluster, preemptor), 120,
         f"{name}'s pods to go", interval=0.2)
    return result


def run_round(round_: int, order: list[str], offset: int, args: argparse.Namespace, scratch: Path
              ) -> dict[str, Result]:
    with Cluster(scratch / f"round-{round_ + 1}", kueue=True, node_labels=FLAVOR_LABEL,
                 extra_env={"PYTHONPATH": str(BENCH)}) as cluster:
        for document in one_queue(NS, cpus="2", flavor_labels=FLAVOR_LABEL):
            cluster.apply(document)
        start_operator(cluster)
        results = {}
        for scenario in order:
            name = f"{scenario}-{round_ + 1}"
            try:
                results[scenario] = run_scenario(cluster, scenario, name, offset, args, scratch)
            except TimeoutError as error:  # reported, and left out of the medians
                results[scenario] = Result(problems=[f"{name}: {error}"])
            r = results[scenario]
            print(f"round {round_ + 1} {scenario:<8} lost {r.lost:g} steps (step {r.at_eviction} at the eviction, "
                  f"checkpoint {r.checkpoint}, resumed from {r.resumed_from}; groups' forwards {r.groups}), every "
                  f"rank pod deleted {r.marked:.2f} s, gone {r.gone:.2f} s, quota back {r.quota:.2f} s, preemptor "
                  f"admitted {r.admitted:.2f} s, training again {r.again:.2f} s; restarts {r.restarts}, evictions "
                  f"{r.evictions}; load {os.getloadavg()[0]:.2f}", flush=True)
        log = cluster.process_log("operator")
        if "Traceback" in log:
            for result in results.values():
                result.problems.append(f"round {round_ + 1}: a traceback in the operator's log")
        cluster.stop_process("operator")
    return results


# -- the table ----------------------------------------------------------------------------------------------------
def median(values) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def cell(values: list[float], digits: int) -> str:
    shown = " / ".join("-" if v != v else f"{v:.{digits}f}" for v in values)
    return f"**{median(values):.{digits}f}** ({shown})" if any(v == v for v in values) else "-"


def table(runs: dict[str, list[Result]], scenarios: list[str], every: int) -> None:
    print("\n| scenario | steps lost | step at the eviction (checkpoint) -> resumed from | eviction to every rank pod "
          "deleted (s) | ... gone (s) | to quota given back (s) | to preemptor admitted (s) | to training again (s) "
          "| restarts, evictions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for scenario in scenarios:
        results = runs[scenario]
        points = " / ".join(f"{r.at_eviction} ({r.checkpoint}) -> {r.resumed_from}" for r in results)
        counts = " / ".join(f"{r.restarts}, {r.evictions}" for r in results)
        print(f"| {TITLES[scenario]} | {cell([r.lost for r in results], 0)} | {points} | "
              f"{cell([r.marked for r in results], 2)} | {cell([r.gone for r in results], 2)} | "
              f"{cell([r.quota for r in results], 2)} | "
              f"{cell([r.admitted for r in results], 2)} | {cell([r.again for r in results], 2)} | {counts} |")
    if "kueue" in runs:
        print("\nkueue: seconds from creating the preemptor to the eviction: "
              + cell([r.decided for r in runs["kueue"]], 2))
    lost = {s: median(r.lost for r in runs[s]) for s in scenarios}
    gone = {s: median(r.gone for r in runs[s]) for s in scenarios}
    if "kueue" in runs and "killed" in runs:
        difference = lost["killed"] - lost["kueue"]
        ratio = "infinite (Kueue lost none)" if lost["kueue"] == 0 else f"{lost['killed'] / lost['kueue']:.1f}x"
        print(f"steps lost, killed less Kueue: {difference:g} steps (medians); killed / Kueue: {ratio}; the most a "
              f"kill can lose is everySteps - 1 = {every - 1}")
    if "kueue" in runs and "deleted" in runs:
        print(f"eviction to every rank pod gone, Kueue / plain deletion: {gone['kueue'] / gone['deleted']:.2f}x "
              f"({gone['kueue']:.2f} s / {gone['deleted']:.2f} s)")
    if "kueue" in runs and "killed" in runs:
        print(f"eviction to every rank pod gone, Kueue / killed: {gone['kueue']:.2f} s against {gone['killed']:.2f} s")



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (medians; default 3)")
    parser.add_argument("--only", action="append", choices=SCENARIOS, help="this scenario only (repeatable)")
    parser.add_argument("--every", type=int, default=50, help="checkpoint.everySteps (default 50)")
    parser.add_argument("--base", type=int, default=100,
                        help="the periodic checkpoint past which the job is stopped (a multiple of --every)")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="pause in each training forward")
    parser.add_argument("--preemptor-seconds", type=float, default=1.0, help="how long the preemptor's ranks run")
    parser.add_argument("--seed", type=int, default=19, help="draws each round's offset past the checkpoint")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    if args.base % args.every or args.base + args.every >= MAX_STEPS:
        parser.error(f"--base must be a multiple of --every, with a whole interval after it before {MAX_STEPS}")
    scenarios = [s for s in SCENARIOS if s in (args.only or SCENARIOS)]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    print(f"{os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; commit "
          f"{head.stdout.strip()}", flush=True)
    draw = random.Random(args.seed)
    started = time.monotonic()
    runs: dict[str, list[Result]] = {s: [] for s in scenarios}
    with tempfile.TemporaryDirectory(prefix="bench-preemption-") as scratch:
        for round_ in range(args.rounds):
            order = scenarios[round_ % len(scenarios):] + scenarios[:round_ % len(scenarios)]
            offset = draw.randint(args.every // 5, args.every - args.every // 5)
            print(f"round {round_ + 1}: order {', '.join(order)}; stopped once rank 0 computed step "
                  f"{args.base + offset} ({offset} past the checkpoint of step {args.base})", flush=True)
            for scenario, result in run_round(round_, order, offset, args, Path(scratch)).items():
                runs[scenario].append(result)
    table(runs, scenarios, args.every)
    problems = [p for s in scenarios for r in runs[s] for p in r.problems]
    for problem in problems:
        print("PROBLEM:", problem)
    print(f"took {time.monotonic() - started:.0f} s; load average now {os.getloadavg()[0]:.2f}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
