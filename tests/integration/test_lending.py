"""Serving borrows training's GPUs (spec.elastic.lendTo) end to end: `tandem operator` as a real process against
the emulated cluster, one node with 3 `nvidia.com/gpu` (two nodes of one each for a pool pinned to one of them;
the scheduler counts them as kube-scheduler does and says `Insufficient nvidia.com/gpu` for a pod that fits
nowhere), real gloo ranks training digits on CPU in their pods
(each asking for one GPU, the device unused: no CUDA here), and real `tandem serve` processes as the pool's replicas
(one GPU each). Mocked: nothing of Tandem's; the API server, kubelet, scheduler and Deployment controller are the
harness's emulations (devcluster/), and the pool's autoscaler is played by the test (`kubectl scale`'s request on
its scale subresource)."""

from __future__ import annotations

import time

import pytest
from jobs import TESTS
from operator_runs import (
    GPU,
    GROUP,
    JOBS,
    NS,
    POOLS,
    READY,
    STARTUP,
    VERSION,
    Client,
    gpu_pool,
    job_pods,
    lending_job,
    ready_hosts,
    scale,
    server_pods,
    start_operator,
    status,
)
from operator_runs import events as reasons

from devcluster import Cluster

WINDOW = 4
"""The job's stabilizationWindowSeconds: short, for the test."""
DECIDED = 3
"""Seconds in which the operator has looked at a change (it is woken by it at once, and looks every 5 s anyway)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cluster"), capacity={GPU: "3"},
                 extra_env={"PYTHONPATH": str(TESTS)}) as cluster:
        start_operator(cluster)
        yield cluster


def unplaced(cluster: Cluster, pool: str) -> None:
    """Wait for a replica of `pool` to be Unschedulable for want of a GPU, then a few seconds more: time for the
    operator, woken by that pod's change, to decide on it (a loan it made would show by then)."""
    cluster.wait_for(lambda: any(GPU in c.get("message", "") for p in server_pods(cluster, pool)
                                 for c in p.get("status", {}).get("conditions", []) if c["type"] == "PodScheduled"),
                     30, f"a replica of {pool} short of a GPU")
    time.sleep(DECIDED)


def wait(cluster: Cluster, check, timeout: float, what: str, job: str, pool: str):
    try:
        return cluster.wait_for(check, timeout, what)
    except TimeoutError:
        print(cluster.process_log("operator")[-5000:])
        print("job:", status(cluster, JOBS, job))
        print("pool:", status(cluster, POOLS, pool))
        for pod in job_pods(cluster, job) + server_pods(cluster, pool):
            print(pod["metadata"]["name"], pod.get("status", {}).get("phase"),
                  [c.get("message") for c in pod.get("status", {}).get("conditions", [])])
        raise


def test_a_pool_short_of_gpus_borrows_a_worker_at_a_step_boundary_and_gives_it_back_when_its_load_falls(
        cluster, tmp_path):
    """Two ranks (one GPU each) and one server (one GPU) fill the node. The pool is scaled to 2 (its autoscaler
    would, under load): its new replica is Pending, Insufficient nvidia.com/gpu; the job lends it one worker (a
    Lent Event, status.lent, the pool's status.borrowed), rank 1 leaves at a step boundary (no step lost, rank 0's
    pod and process kept), and the new replica becomes Ready on the freed GPU, a client's requests never failing
    meanwhile. A pool the job does not select, short of a GPU, borrows nothing; nor does the lending pool's third
    replica once the job is at minWorkers. The pool scaled back to 1, the job takes the worker back once the window
    has passed (a TookBack Event): rank 1 joins, and the job Succeeds with nothing restarted."""
    go = tmp_path / "go"
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, POOLS, gpu_pool("online", {"tier": "online"}))
    wait(cluster, lambda: status(cluster, POOLS, "online").get("phase") == "Ready", READY, "the pool Ready",
         "lender", "online")
    job = lending_job("lender", go, {"tier": "online"}, WINDOW, epochs=15, step_seconds=0.2)
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, job)
    wait(cluster, lambda: (status(cluster, JOBS, "lender").get("progress") or {}).get("step", 0) >= 5, STARTUP,
         "the job training", "lender", "online")
    rank_0 = cluster.kubelet.pid(NS, "lender-worker-0")
    client = Client(lambda: ready_hosts(cluster, "online"))
    client.start()
    try:
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, POOLS, gpu_pool("batch", {"tier": "batch"}))
        unplaced(cluster, "batch")
        assert "lent" not in status(cluster, JOBS, "lender"), "a pool the job does not select borrows nothing"
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, POOLS, "batch")

        scale(cluster, POOLS, "online", 2)
        lent = wait(cluster, lambda: (s := status(cluster, JOBS, "lender")).get("lent") and s, 30,
                    "the job to lend a worker", "lender", "online")
        assert (lent["lent"]["workers"], lent["lent"]["to"]) == (1, ["online"])
        wait(cluster, lambda: status(cluster, POOLS, "online").get("readyReplicas") == 2, READY,
             "the pool's second replica Ready on the lent GPU", "lender", "online")
        left = wait(cluster, lambda: (s := status(cluster, JOBS, "lender")).get("lastRecovery", {}).get("workers")
                    == 1 and s, 60, "rank 1 to leave", "lender", "online")
        recovery = left["lastRecovery"]
        assert recovery["resumedAtStep"] == recovery["stoppedAtStep"], f"a step lost: {recovery}"
        assert status(cluster, POOLS, "online")["borrowed"]["workers"] == 1
        assert status(cluster, POOLS, "online")["borrowed"]["from"] == ["lender"]
        assert [p["metadata"]["name"] for p in job_pods(cluster, "lender")] == ["lender-coordinator",
                                                                                "lender-worker-0"]

        scale(cluster, POOLS, "online", 3)
        unplaced(cluster, "online")
        held = status(cluster, JOBS, "lender")
        assert held["lent"]["workers"] == 1, "minWorkers holds: no second worker lent"
        assert len(job_pods(cluster, "lender")) == 2

        scale(cluster, POOLS, "online", 1)
        back = wait(cluster, lambda: (s := status(cluster, JOBS, "lender")).get("lastRecovery", {}).get("added")
                    == [1] and s, 90, "rank 1 to join again", "lender", "online")
        assert "lent" not in back and back["restarts"] == 0
        wait(cluster, lambda: "borrowed" not in status(cluster, POOLS, "online"), 10, "the pool to borrow nothing",
             "lender", "online")
    finally:
        client.stop.set()
        client.join(timeout=60)
    assert client.failures == [] and client.answered > 0
    assert cluster.kubelet.pid(NS, "lender-worker-0") == rank_0, "rank 0's process trained throughout"
    go.touch()
    final = wait(cluster, lambda: (s := status(cluster, JOBS, "lender")).get("phase") == "Succeeded" and s, 120,
                 "the job to succeed", "lender", "online")
    assert (final["restarts"], final["progress"]["step"]) == (0, final["progress"]["totalSteps"])
    job_events = reasons(cluster, "lender")
    assert "Lent" in job_events and "TookBack" in job_events and "Restarting" not in job_events, job_events
    messages = [e["message"] for e in cluster.list("events", NS) if e["involvedObject"]["name"] == "lender"]
    assert any(m.startswith("Lent 1 worker to InferencePool online") for m in messages), messages
    assert any(m.startswith("Took back 1 worker from InferencePool online") for m in messages), messages
    scale(cluster, POOLS, "online", 0)


def test_a_pool_that_cannot_run_where_the_lent_rank_ran_gives_the_worker_back_and_borrows_nothing_more(tmp_path):
    """Two nodes of one GPU each, a rank on each. A pool pinned (nodeSelector) to rank 0's node is short of a GPU
    there: the job lends it rank 1, whose GPU is on the other node, where the pool's replica may not run. With rank
    1's pod gone and the replica still unplaced past placementDeadlineSeconds (5 s here), the job takes the worker
    back (a TookBack Event saying why), rank 1 joins again with nothing restarted, and the pool, listed in
    status.lent.unplaceable, is lent nothing more while it stays short."""
    go = tmp_path / "go"
    with Cluster(tmp_path / "cluster", nodes=2, capacity={GPU: "1"}, extra_env={"PYTHONPATH": str(TESTS)}) as two:
        start_operator(two)
        job = lending_job("lender", go, {"tier": "online"}, WINDOW, step_seconds=0.2)
        job["spec"]["elastic"]["lendTo"]["placementDeadlineSeconds"] = 5
        two.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, job)
        wait(two, lambda: (status(two, JOBS, "lender").get("progress") or {}).get("step", 0) >= 5, STARTUP,
             "the job training", "lender", "pinned")
        nodes = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in job_pods(two, "lender")}
        assert nodes["lender-worker-0"] != nodes["lender-worker-1"], nodes
        pool = gpu_pool("pinned", {"tier": "online"})
        pool["spec"]["nodeSelector"] = {"kubernetes.io/hostname": nodes["lender-worker-0"]}
        two.custom.create_namespaced_custom_object(GROUP, VERSION, NS, POOLS, pool)

        given_back = wait(two, lambda: (s := status(two, JOBS, "lender")).get("lent", {}).get("unplaceable") and s,
                          60, "the job to take its worker back from the pool that could not use it", "lender",
                          "pinned")
        assert given_back["lent"]["workers"] == 0 and given_back["lent"]["pools"] == []
        assert [entry["name"] for entry in given_back["lent"]["unplaceable"]] == ["pinned"]
        back = wait(two, lambda: (s := status(two, JOBS, "lender")).get("lastRecovery", {}).get("added") == [1]
                    and s, 60, "rank 1 to join again", "lender", "pinned")
        assert back["restarts"] == 0
        time.sleep(DECIDED)
        assert status(two, JOBS, "lender")["lent"]["workers"] == 0, "the pool is lent nothing more"
        assert len(job_pods(two, "lender")) == 3
        wait(two, lambda: status(two, POOLS, "pinned").get("borrowed") == {"workers": 0, "from": [],
                                                                        "unplaceableFor": ["lender"]},
             10, "the pool to show which job found it could not use its workers", "lender", "pinned")
        messages = [e["message"] for e in two.list("events", NS) if e["involvedObject"]["name"] == "lender"]
        assert [m for m in messages if m.startswith("Lent ")] == [
            "Lent 1 worker to InferencePool pinned: 1 replica could not be placed for want of what the ranks hold; "
            "they leave at a step boundary, the others train on (spec.elastic.lendTo)"], messages
        assert any(m.startswith("Took back 1 worker from InferencePool pinned: none of its replicas was placed in 5 s "
                                "with them free") for m in messages), messages


def test_two_jobs_woken_by_one_short_replica_lend_one_worker_between_them(tmp_path):
    """Two lending jobs (two ranks of one GPU each) and a pool of one replica fill a node of 5 GPUs. The pool scaled
    to 2, its new replica short of a GPU wakes both jobs' daemons at once: the first to decide lends one worker, and
    the second counts that loan (its rank still leaving, the replica still Pending) and lends nothing, so the pool
    borrows one worker, not two."""
    go = tmp_path / "go"
    with Cluster(tmp_path / "cluster", capacity={GPU: "5"}, extra_env={"PYTHONPATH": str(TESTS)}) as five:
        start_operator(five)
        five.custom.create_namespaced_custom_object(GROUP, VERSION, NS, POOLS, gpu_pool("online", {"tier": "online"}))
        for name in ("first", "second"):
            job = lending_job(name, go, {"tier": "online"}, WINDOW, step_seconds=0.2)
            five.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, job)
        for name in ("first", "second"):
            wait(five, lambda name=name: (status(five, JOBS, name).get("progress") or {}).get("step", 0) >= 2,
                 STARTUP, f"{name} training", name, "online")
        wait(five, lambda: status(five, POOLS, "online").get("phase") == "Ready", READY, "the pool Ready", "first",
             "online")

        scale(five, POOLS, "online", 2)
        wait(five, lambda: status(five, POOLS, "online").get("readyReplicas") == 2, READY,
             "the pool's second replica Ready on a lent GPU", "first", "online")
        time.sleep(DECIDED)
        lent = {name: (status(five, JOBS, name).get("lent") or {}).get("workers", 0) for name in ("first", "second")}
        assert sorted(lent.values()) == [0, 1], f"one replica short, {lent} workers lent"
        assert status(five, POOLS, "online")["borrowed"]["workers"] == 1
        assert sorted(len(job_pods(five, name)) for name in ("first", "second")) == [2, 3]
        messages = [e["message"] for e in five.list("events", NS) if e["reason"] == "Lent"]
        assert len(messages) == 1, messages
