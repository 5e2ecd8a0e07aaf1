"""Operator failover (issue 37): how long no job starts after the leading operator replica dies or stops, with
leader election through a Lease (`tandem operator --leader-elect`, controller-runtime's durations: 15 s lease, 10 s
renew deadline, 2 s retry period) side by side with kopf's peering (`--peering`, random priorities), in one run.

One emulated cluster (devcluster/: the API emulator and the test kubelet running pods as local processes; kopf's
peering CRDs from the chart). Each round, for each coordination (the order flips each round) and each way the
leader goes (SIGKILL: a crash; SIGTERM: a rolling update's stop), two fresh replicas are started, the first to lead
is started first, a job is applied and its pods created, the second replica stands by for a few seconds, the one
that works is found (the Lease's holder; under peering the peer of highest priority, which may be the second: kopf
pauses the others), then it is killed or stopped and at once a
new job (2 ranks, custom mode: no torch) is applied. Measured: from the signal to both of the new job's rank pods
existing in the API. The replicas are then stopped and the jobs deleted.

    .venv/bin/python bench/bench_failover.py                 # 3 rounds
    .venv/bin/python bench/bench_failover.py --rounds 1 --only lease
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from operator_runs import GROUP, JOBS, NS, VERSION, custom_job, job_pods  # noqa: E402

from devcluster import Cluster  # noqa: E402
from devcluster.harness import CRDS  # noqa: E402

PEERING_CRDS = ROOT / "charts" / "tandem" / "crds" / "kopf.dev_peerings.yaml"
STANDBY_SECONDS = 5.0  # the second replica's time standing by before the leader goes
WAIT = 240.0


def start(cluster: Cluster, name: str, coordination: list[str]) -> None:
    cluster.spawn([sys.executable, "-m", "tandem.cli", "operator", "--namespace", NS, "--restart-backoff-seconds",
                   "0", "--worker-image", "tandem-worker:bench", *coordination], name=name, cwd=ROOT, client=name,
                  env=cluster.environ(POD_ID=name))  # kopf's name for it in the peering object


def leader_of(cluster: Cluster, coordination: str, tag: str, names: list[str]) -> str:
    """The replica that works now: the Lease's holder (each logs its identity), or under kopf's peering the peer of
    highest priority in the KopfPeering's status (the others pause)."""
    if coordination == "lease":
        holder = ((cluster.get("leases", NS, f"bench-{tag}") or {}).get("spec") or {}).get("holderIdentity") or "?"
        return next(name for name in names if holder in cluster.process_log(name))
    peers = (cluster.get("kopfpeerings", NS, f"bench-{tag}") or {}).get("status") or {}
    assert set(peers) == set(names), f"both replicas peer: {peers}"
    return max(peers, key=lambda peer: peers[peer]["priority"])


def pods_of(cluster: Cluster, job: str) -> int:
    return len(job_pods(cluster, job))


def one(cluster: Cluster, coordination: str, how: str) -> float:
    tag = uuid.uuid4().hex[:6]
    names = [f"{coordination}-{how}-{tag}-{side}" for side in "ab"]
    if coordination == "lease":
        flags = ["--leader-elect", "--leader-election-id", f"bench-{tag}"]
    else:
        cluster.apply({"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": f"bench-{tag}"}})
        flags = ["--peering", f"bench-{tag}"]
    first, second = f"first-{tag}", f"second-{tag}"
    start(cluster, names[0], flags)
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, custom_job(first))
    cluster.wait_for(lambda: pods_of(cluster, first) == 2, WAIT, "the first replica to lead")
    start(cluster, names[1], flags)
    time.sleep(STANDBY_SECONDS)
    leader = leader_of(cluster, coordination, tag, names)
    process = cluster._processes[leader][0]
    began = time.monotonic()
    process.send_signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, custom_job(second))
    cluster.wait_for(lambda: pods_of(cluster, second) == 2, WAIT, "the other replica to start the new job")
    took = time.monotonic() - began
    for job in (first, second):  # while a replica leads: kopf's finalizer goes with it
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, JOBS, job)
    cluster.wait_for(lambda: not pods_of(cluster, first) and not pods_of(cluster, second), WAIT, "the jobs to go")
    for name in names:
        cluster.stop_process(name)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("lease", "peering"))
    args = parser.parse_args()
    coordinations = [args.only] if args.only else ["lease", "peering"]
    found: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as directory, \
            Cluster(Path(directory), crds=[CRDS, PEERING_CRDS]) as cluster:
        for round_ in range(args.rounds):
            for coordination in coordinations if round_ % 2 == 0 else coordinations[::-1]:
                for how in ("SIGKILL", "SIGTERM"):
                    took = one(cluster, coordination, how)
                    found.setdefault((coordination, how), []).append(took)
                    print(f"round {round_ + 1}: {coordination:7s} leader {how}: a new job's pods after {took:5.1f} s",
                          flush=True)
    print(f"\nFrom the leader's signal to a new job's rank pods, median (range) of {args.rounds} round(s):")
    print("| the leader gets | " + " | ".join(
        "Lease (--leader-elect, 15 s lease)" if c == "lease" else "kopf peering" for c in coordinations) + " |")
    print("|---|" + "---|" * len(coordinations))
    for how in ("SIGKILL", "SIGTERM"):
        cells = [found[c, how] for c in coordinations]
        print(f"| {how} | " + " | ".join(f"{statistics.median(v):.1f} s ({min(v):.1f}-{max(v):.1f})" for v in cells)
              + " |")


if __name__ == "__main__":
    main()
