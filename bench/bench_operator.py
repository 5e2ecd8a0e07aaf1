"""The operator at scale, against the emulated API server (devcluster/, no kubelet and no Deployment controller: pods
are created and stay unscheduled, Deployments make no pods), with the operator's CPU time and peak memory. Side by
side, in the same run, a minimal kopf operator that writes the one kind of object the measure waits for and nothing
else — the floor that kopf and the API set.

- jobs: from creating N ParallelTrainingJobs (2 ranks each) to all their rank pods existing. The minimal operator
  creates the same two pods per job (no Service, ConfigMap, RBAC, status or events).
- pools: from creating N InferencePools (2 replicas, a `callable` model: no training job) to each pool's Deployment,
  Service, ConfigMap and PodDisruptionBudget existing and its status written for the pool's generation (phase Pending
  or Loading with `observedGeneration` = the pool's generation: the daemon patches the status after applying every
  object of the pass, so this means the operator has decided and applied everything for the pool). No server pod
  exists, so the daemon asks no server over HTTP. The minimal operator creates only a Deployment per pool.

    .venv/bin/python bench/bench_operator.py                  # jobs, N = 1, 10, 100; about a minute on 2 cores
    .venv/bin/python bench/bench_operator.py --kind pools --rounds 3 --requests
    .venv/bin/python bench/bench_operator.py --count 100 --rounds 3

`--requests` adds each operator's API requests per object created, by verb and resource (kmock records them).
Targets: 100 jobs in under 10 s and 200 MB (issue 10); 100 pools in under 10 s and 200 MB.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from devcluster import Cluster  # noqa: E402

GROUP, VERSION, NS = "tandem.dev", "v1alpha1", "default"
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
    memo.apps = kubernetes.client.AppsV1Api()
'''

MINIMAL_JOBS = MINIMAL + '''
@kopf.on.create("tandem.dev", "v1alpha1", "paralleltrainingjobs")
def create(name, namespace, body, memo, **_):
    for rank in range(2):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-worker-{rank}",
               "labels": {"tandem.dev/job": name}},
               "spec": {"containers": [{"name": "worker", "image": "tandem-worker:bench"}]}}
        kopf.adopt(pod, owner=body)
        memo.core.create_namespaced_pod(namespace, pod)
'''

MINIMAL_POOLS = MINIMAL + '''
@kopf.on.create("tandem.dev", "v1alpha1", "inferencepools")
def create(name, namespace, body, memo, **_):
    labels = {"tandem.dev/pool": name}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"{name}-server",
                  "labels": labels},
                  "spec": {"replicas": body["spec"]["replicas"], "selector": {"matchLabels": labels},
                           "template": {"metadata": {"labels": labels}, "spec": {"containers": [
                               {"name": "server", "image": "tandem-worker:bench"}]}}}}
    kopf.adopt(deployment, owner=body)
    memo.apps.create_namespaced_deployment(namespace, deployment)
'''


def names(cluster: Cluster, resource: str) -> set[str]:
    """The names of the stored objects of a kind in NS, read without copying them (a benchmark's poll must not load
    the emulator, which shares this process)."""
    store, kind = cluster.emulator.store, cluster.emulator.catalog.lookup(resource)
    return {key[2] for key in store.keys(kind.resource, NS)}


def live(cluster: Cluster, resource: str, name: str) -> dict | None:
    """The stored object itself, not a copy (never mutate it)."""
    emulator = cluster.emulator
    return emulator.store.live(emulator.writer.key(emulator.catalog.lookup(resource), NS, name))


@dataclass(frozen=True)
class Kind:
    """What the benchmark creates, and when each operator is done with the objects named."""

    plural: str
    prefix: str  # of the objects' names
    manifest: Callable[[str], dict]
    minimal: str
    done: dict[str, Callable[[Cluster, list[str]], bool]]  # operator: predicate
    what: str  # what the wait is for, per object


def job(name: str) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": name},
            "spec": {"workers": 2, "trainer": {"model": "tandem.examples.digits:mlp",
                                               "data": "tandem.examples.digits:train_data"}}}


def pool(name: str) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferencePool", "metadata": {"name": name},
            "spec": {"replicas": 2, "model": {"callable": "tandem.examples.digits:mlp", "inputShape": [64]}}}


def pods_exist(cluster: Cluster, jobs: list[str]) -> bool:
    return len(names(cluster, "pods")) >= 2 * len(jobs)


POOL_CHILDREN = {"deployments": "{}-server", "services": "{}", "configmaps": "{}-spec",
                 "poddisruptionbudgets": "{}-server"}
DECIDED = ("Pending", "Loading")  # no kubelet: no pod ever runs, so a decided pool is Pending


def pools_applied(cluster: Cluster, pools: list[str]) -> bool:
    """Every pool's status written for its generation, and every object it wants there."""
    for name in pools:
        found = live(cluster, "inferencepools", name)
        status = (found or {}).get("status") or {}
        if status.get("phase") not in DECIDED or status.get("observedGeneration") != found["metadata"]["generation"]:
            return False
    existing = {resource: names(cluster, resource) for resource in POOL_CHILDREN}
    return all(template.format(name) in existing[resource] for name in pools
               for resource, template in POOL_CHILDREN.items())


def deployments_exist(cluster: Cluster, pools: list[str]) -> bool:
    return {f"{name}-server" for name in pools} <= names(cluster, "deployments")


KINDS = {
    "jobs": Kind("paralleltrainingjobs", "job", job, MINIMAL_JOBS,
                 {"tandem": pods_exist, "minimal": pods_exist}, "its 2 pods"),
    "pools": Kind("inferencepools", "pool", pool, MINIMAL_POOLS,
                  {"tandem": pools_applied, "minimal": deployments_exist}, "its objects and status"),
}


def process_usage(pid: int) -> tuple[float, float]:
    """(CPU seconds, peak resident MiB) of a running process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    peak = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmHWM:")) / 1024
    return cpu, peak


RESOURCE = re.compile(r"/namespaces/[^/]+/([^/]+)(?:/[^/]+(/[^/]+)?)?$")


def requests_by_kind(requests: list, plural: str) -> Counter:
    """The API requests the operator made: {"VERB resource[/subresource]": count}, less the benchmark's creates."""
    found = Counter()
    for request in requests:
        match = RESOURCE.search(request.url.path)
        if match is None:
            continue
        verb = "WATCH" if request.params.get("watch") else str(request.method).rsplit(".", 1)[-1]
        what = f"{verb} {match[1]}{match[2] or ''}"
        if what != f"POST {plural}":
            found[what] += 1
    return found


def measure(kind: Kind, operator: str, count: int, scratch: Path) -> tuple[float, float, float, Counter]:
    """(seconds from the first create to the operator being done with every object, the operator's CPU seconds in
    that time, its peak MiB, the API requests in that time by verb and resource)."""
    done = kind.done[operator]
    with Cluster(scratch / f"{kind.plural}-{operator}-{count}", kubelet=False, deployments=False) as cluster:
        if operator == "tandem":
            argv = [sys.executable, "-m", "tandem.cli", "operator", "--namespace", NS]
        else:
            (scratch / "minimal.py").write_text(kind.minimal)
            argv = [sys.executable, "-m", "kopf", "run", "--namespace", NS, str(scratch / "minimal.py")]
        process = cluster.spawn(argv, name="operator", cwd=ROOT)
        # A first object, timed out of the figures: the operator is up and watching once it is done with it.
        created = ["warm-up"]
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, kind.plural, kind.manifest("warm-up"))
        cluster.wait_for(lambda: done(cluster, created), 60, f"the warm-up: {kind.what}")
        cpu_before, _ = process_usage(process.pid)
        first = len(list(cluster.emulator))  # the requests the emulator has answered (kmock's view of them)
        started = time.perf_counter()
        for index in range(count):
            created.append(f"{kind.prefix}-{index}")
            cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, kind.plural, kind.manifest(created[-1]))
        cluster.wait_for(lambda: done(cluster, created), 120, f"{count} {kind.plural}: {kind.what}", interval=0.02)
        elapsed = time.perf_counter() - started
        cpu_after, peak = process_usage(process.pid)
        requests = requests_by_kind(list(cluster.emulator)[first:], kind.plural)
        cluster.stop_process("operator")
    return elapsed, cpu_after - cpu_before, peak, requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=sorted(KINDS), default="jobs", help="what to create (default jobs)")
    parser.add_argument("--count", "--jobs", type=int, action="append", dest="counts",
                        help="N (repeatable; default 1, 10, 100)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per N (medians)")
    parser.add_argument("--requests", action="store_true",
                        help="also print each operator's API requests per object created (its last round)")
    args = parser.parse_args()
    kind = KINDS[args.kind]

    with tempfile.TemporaryDirectory() as scratch:
        for count in args.counts or [1, 10, 100]:
            results = {"tandem": [], "minimal": []}
            for _ in range(args.rounds):
                for operator in ("tandem", "minimal"):
                    results[operator].append(measure(kind, operator, count, Path(scratch)))
            line = []
            for operator, runs in results.items():
                seconds, cpu, peak = (statistics.median(run[i] for run in runs) for i in range(3))
                line.append(f"{operator}: {seconds:.2f} s, CPU {cpu:.2f} s, peak {peak:.0f} MiB")
            ratio = statistics.median(r[0] for r in results["tandem"]) / statistics.median(
                r[0] for r in results["minimal"])
            print(f"{args.kind} N={count:<4d} {' | '.join(line)} | tandem / minimal time {ratio:.2f}", flush=True)
            if args.requests:
                for operator, runs in results.items():
                    made = ", ".join(f"{what} {n / count:.2f}" for what, n in sorted(runs[-1][3].items()))
                    print(f"    {operator}, requests per {args.kind[:-1]}: {made}", flush=True)


if __name__ == "__main__":
    main()
