"""The operator at scale: from creating N ParallelTrainingJobs (2 ranks each) to all their rank pods existing on the
emulated API server (devcluster/, no kubelet: the pods are created and stay unscheduled), with the operator's CPU
time and peak memory. Side by side, in the same run: a minimal kopf operator that creates the same two pods per job
and nothing else (no Service, ConfigMap, RBAC, status or events) — the floor that kopf and the API set.

    .venv/bin/python bench/bench_operator.py                  # N = 1, 10, 100; about a minute on 2 cores
    .venv/bin/python bench/bench_operator.py --jobs 100 --rounds 3

Target (issue 10): 100 jobs in under 10 s and 200 MB.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from devcluster import Cluster  # noqa: E402

GROUP, VERSION, JOBS = "tandem.dev", "v1alpha1", "paralleltrainingjobs"
CLOCK_TICKS = 100  # /proc/<pid>/stat counts CPU time in clock ticks (USER_HZ, 100 on Linux)

MINIMAL = '''
import kopf, kubernetes

@kopf.on.startup()
def configure(settings, memo, **_):
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="bench.tandem.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="bench.tandem.dev")
    settings.posting.enabled = False
    kubernetes.config.load_kube_config()
    memo.core = kubernetes.client.CoreV1Api()

@kopf.on.create("tandem.dev", "v1alpha1", "paralleltrainingjobs")
def create(name, namespace, body, memo, **_):
    for rank in range(2):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-worker-{rank}",
               "labels": {"tandem.dev/job": name}},
               "spec": {"containers": [{"name": "worker", "image": "tandem-worker:bench"}]}}
        kopf.adopt(pod, owner=body)
        memo.core.create_namespaced_pod(namespace, pod)
'''


def job(index: int) -> dict:
    name = "warm-up" if index < 0 else f"job-{index}"
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": name},
            "spec": {"workers": 2, "trainer": {"model": "tandem.examples.digits:mlp",
                                               "data": "tandem.examples.digits:train_data"}}}


def process_usage(pid: int) -> tuple[float, float]:
    """(CPU seconds, peak resident MiB) of a running process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    peak = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmHWM:")) / 1024
    return cpu, peak


def measure(operator: str, jobs: int, scratch: Path) -> tuple[float, float, float]:
    """(seconds from the first create to every pod existing, the operator's CPU seconds in that time, its peak MiB)."""
    with Cluster(scratch / f"{operator}-{jobs}", kubelet=False) as cluster:
        if operator == "tandem":
            argv = [sys.executable, "-m", "tandem.cli", "operator", "--namespace", "default"]
        else:
            (scratch / "minimal.py").write_text(MINIMAL)
            argv = [sys.executable, "-m", "kopf", "run", "--namespace", "default", str(scratch / "minimal.py")]
        process = cluster.spawn(argv, name="operator", cwd=ROOT)
        # A first job, timed out of the figures: the operator is up and watching once its pods exist.
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, "default", JOBS, job(-1))
        cluster.wait_for(lambda: len(cluster.list("pods", "default")) == 2, 60, "the warm-up job's pods")
        cpu_before, _ = process_usage(process.pid)
        started = time.perf_counter()
        for index in range(jobs):
            cluster.custom.create_namespaced_custom_object(GROUP, VERSION, "default", JOBS, job(index))
        cluster.wait_for(lambda: len(cluster.list("pods", "default")) >= 2 * jobs + 2, 120, f"{2 * jobs} pods",
                         interval=0.02)
        elapsed = time.perf_counter() - started
        cpu_after, peak = process_usage(process.pid)
        cluster.stop_process("operator")
    return elapsed, cpu_after - cpu_before, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, action="append", help="N (repeatable; default 1, 10, 100)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per N (medians)")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        for jobs in args.jobs or [1, 10, 100]:
            results = {"tandem": [], "minimal": []}
            for _ in range(args.rounds):
                for operator in ("tandem", "minimal"):
                    results[operator].append(measure(operator, jobs, Path(scratch)))
            line = []
            for operator, runs in results.items():
                seconds, cpu, peak = (statistics.median(run[i] for run in runs) for i in range(3))
                line.append(f"{operator}: {seconds:.2f} s, CPU {cpu:.2f} s, peak {peak:.0f} MiB")
            ratio = statistics.median(r[0] for r in results["tandem"]) / statistics.median(
                r[0] for r in results["minimal"])
            print(f"N={jobs:<4d} {' | '.join(line)} | tandem / minimal time {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
