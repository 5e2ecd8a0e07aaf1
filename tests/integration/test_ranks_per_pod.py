"""Several ranks in one pod (spec.ranksPerPod). The worker's side: the pod's launcher (`tandem worker launch`) run as a
pod runs it, by hand, with the environment the operator writes (WorkerContract.pod_environ). The operator's side:
`tandem operator` on the emulated cluster (devcluster/: its API server, kubelet and scheduler are emulations, with
what they leave out in their docstrings), real gloo ranks in pods of two."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import kubernetes
import pytest
import torch
import yaml
from jobs import ROOT, TESTS, final_weights, leftover_processes, manifest, tandem_run
from operator_runs import GROUP, JOBS, NS, STARTUP, VERSION, claim, job_pods, start_operator

from devcluster import Cluster
from tandem.contract import WorkerContract, checkpoint_name
from tandem.worker import checkpoint
from tandem.worker.train.process_group import free_port

DETERMINISTIC = {"deterministic": True, "maxSteps": 12, "evalData": None}


def pod_contract(job: Path, pod: int, ranks_per_pod: int, world_size: int, port: int) -> WorkerContract:
    """The contract of pod `pod` of a job, as the operator writes it: its first rank's, all ranks local to it."""
    spec = yaml.safe_load(job.read_text())
    return WorkerContract(
        rank=pod * ranks_per_pod, world_size=world_size, local_rank=0, local_world_size=ranks_per_pod,
        master_port=port, job=spec["metadata"]["name"], spec_path=job.with_suffix(".json"),
        checkpoint_dir=Path(spec["spec"]["checkpoint"]["directory"]),
    )


def start_pod(job: Path, pod: int, ranks_per_pod: int, world_size: int, port: int, *,
              termination_log: Path | None = None, environ: dict[str, str] | None = None) -> subprocess.Popen:
    """One pod's container: `tandem worker train` for a pod of one rank, `tandem worker launch` for several."""
    job.with_suffix(".json").write_text(json.dumps(yaml.safe_load(job.read_text())))
    contract = pod_contract(job, pod, ranks_per_pod, world_size, port)
    if ranks_per_pod == 1:
        command, variables = ["train"], contract.to_environ()
    else:
        command, variables = ["launch", "--termination-log", str(termination_log or job.parent / f"pod-{pod}.msg")], \
            contract.pod_environ()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           **variables, **(environ or {})}
    log = open(job.parent / f"{job.stem}-pod-{pod}.log", "wb")  # noqa: SIM115 (the pod's log, kept past the test)
    return subprocess.Popen([sys.executable, "-m", "tandem.cli", "worker", *command], env=env, cwd=job.parent,
                            stdout=log, stderr=subprocess.STDOUT)


def run_pods(job: Path, pods: int, ranks_per_pod: int) -> None:
    port = free_port()
    processes = [start_pod(job, pod, ranks_per_pod, pods * ranks_per_pod, port) for pod in range(pods)]
    for pod, process in enumerate(processes):
        assert process.wait(timeout=300) == 0, (job.parent / f"{job.stem}-pod-{pod}.log").read_text()


def test_two_pods_of_two_ranks_four_pods_of_one_and_tandem_run_train_bit_identical_weights(tmp_path):
    """The same 4 ranks, however they are placed in processes and pods, take the same steps exactly (gloo,
    `deterministic: true`, the digits MLP): a launcher that numbered, seeded or sharded its ranks differently from
    the single-rank pods would change the weights."""
    layouts = {"pods-2x2": (2, 2), "pods-4x1": (4, 1)}
    for name, (pods, ranks_per_pod) in layouts.items():
        run_pods(manifest(tmp_path, name, workers=4, ranksPerPod=ranks_per_pod, trainer=DETERMINISTIC), pods,
                 ranks_per_pod)
    local = tandem_run(manifest(tmp_path, "local", workers=4, ranksPerPod=2, trainer=DETERMINISTIC))
    assert local.returncode == 0, local.stderr
    weights = {name: final_weights(tmp_path, name) for name in [*layouts, "local"]}
    assert checkpoint.latest(tmp_path / "pods-2x2" / "checkpoints").name == checkpoint_name(12)
    for name in ("pods-4x1", "local"):
        assert weights[name].keys() == weights["pods-2x2"].keys()
        for key, tensor in weights["pods-2x2"].items():
            assert torch.equal(tensor, weights[name][key]), f"{name}: {key} differs from 2 pods x 2 ranks"


def custom_job(tmp_path: Path, name: str, script: str, workers: int = 4, ranks_per_pod: int = 2) -> Path:
    program = tmp_path / f"{name}.py"
    program.write_text(textwrap.dedent(script))
    return manifest(tmp_path, name, workers=workers, ranksPerPod=ranks_per_pod, trainingMode="custom",
                    custom={"command": [sys.executable, str(program)]})


SEEN = """
    import json, os, sys
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TANDEM_JOB", "TANDEM_SPEC", "CUDA_VISIBLE_DEVICES"]
    seen = {key: os.environ.get(key) for key in keys}
    with open(os.path.join(os.path.dirname(__file__), f"seen-{seen['RANK']}.json"), "w") as out:
        json.dump(seen, out)
    print("hello from", seen["RANK"], flush=True)
"""


def test_each_local_rank_sees_its_own_contract_and_every_gpu_of_the_pod(tmp_path):
    job = custom_job(tmp_path, "contract", SEEN)
    pod = start_pod(job, 1, 2, 4, 29511, environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert pod.wait(timeout=60) == 0
    seen = {rank: json.loads((tmp_path / f"seen-{rank}.json").read_text()) for rank in (2, 3)}
    for local_rank, rank in enumerate((2, 3)):
        assert seen[rank] == {
            "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TANDEM_JOB": "contract",
            "TANDEM_SPEC": str(job.with_suffix(".json")), "CUDA_VISIBLE_DEVICES": "0,1",
        }
    assert not list(tmp_path.glob("seen-[01].json")), "a pod started ranks of another pod"
    log = (tmp_path / "contract-pod-1.log").read_text().splitlines()
    assert {"[rank 2] hello from 2", "[rank 3] hello from 3"} <= set(log), log


FAILING = """
    import os, sys, time
    if os.environ["LOCAL_RANK"] == "1":
        time.sleep(1)
        print("rank 3 ran out of luck", flush=True)
        sys.exit(7)
    time.sleep(120)
"""


def test_a_failed_local_rank_ends_its_siblings_and_the_pod_names_it(tmp_path):
    job = custom_job(tmp_path, "failing", FAILING)
    message = tmp_path / "termination-log"
    started = time.monotonic()
    pod = start_pod(job, 1, 2, 4, 29512, termination_log=message)
    assert pod.wait(timeout=60) == 7
    assert time.monotonic() - started < 30, "the sibling was waited for instead of stopped"
    assert not leftover_processes("failing"), "a sibling rank outlived its pod"
    head, *tail = message.read_text().splitlines()
    assert head == "rank 3 (local rank 1) exited with code 7"
    assert tail[-1] == "rank 3 ran out of luck"


STOPPING = """
    import os, signal, sys, time
    def stop(signum, frame):
        open(os.path.join(os.path.dirname(__file__), f"stopped-{os.environ['RANK']}"), "w").close()
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    open(os.path.join(os.path.dirname(__file__), f"started-{os.environ['RANK']}"), "w").close()
    time.sleep(120)
"""


def test_sigterm_reaches_every_local_rank(tmp_path):
    job = custom_job(tmp_path, "stopping", STOPPING)
    pod = start_pod(job, 0, 2, 4, 29513)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"started-{rank}").exists() for rank in (0, 1)):
        assert pod.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    pod.send_signal(signal.SIGTERM)
    assert pod.wait(timeout=30) == 0
    assert all((tmp_path / f"stopped-{rank}").exists() for rank in (0, 1))


def test_tandem_run_refuses_workers_that_pods_cannot_split(tmp_path):
    result = tandem_run(manifest(tmp_path, "uneven", workers=3, ranksPerPod=2))
    assert result.returncode == 2
    assert "workers (3) must be a multiple of ranksPerPod (2)" in result.stderr


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cluster"), extra_env={"PYTHONPATH": str(TESTS)}) as cluster:
        start_operator(cluster)
        yield cluster


def job_status(cluster: Cluster, name: str) -> dict:
    return (cluster.get("ptj", NS, name) or {}).get("status") or {}


def wait_status(cluster: Cluster, name: str, holds, what: str, timeout: float = STARTUP) -> dict:
    try:
        return cluster.wait_for(lambda: holds(status := job_status(cluster, name)) and status, timeout, what)
    except TimeoutError:
        print(cluster.process_log("operator")[-4000:])
        raise AssertionError(f"{name}: no {what}: {job_status(cluster, name)}") from None


def local_rank_process(launcher: int, rank: int) -> int:
    """The process of global rank `rank` among a pod's launcher's children (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if parent == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no process of rank {rank} under the launcher {launcher}")


def test_four_ranks_in_two_pods_train_restart_and_suspend_on_the_cluster(cluster):
    """The digits example with `workers: 4, ranksPerPod: 2` on a claim: two pods, each with its launcher and two real
    gloo ranks. Killing one local rank's process fails its pod, which names the rank, and the whole group restarts
    from the checkpoint rank 0 recorded; a suspension stops all four ranks with a checkpoint at the step they agree
    on; resumed, the job trains to Succeeded with rank 0's status."""
    document = yaml.safe_load((ROOT / "examples" / "digits-train.yaml").read_text())
    document["metadata"]["name"] = "quad"
    document["spec"].update(workers=4, ranksPerPod=2)
    document["spec"]["checkpoint"].update({"persistentVolumeClaim": "quad-checkpoints", "everySteps": 20,
                                           "directory": "quad"})
    claim(cluster, "quad-checkpoints")
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, document)
    running = wait_status(cluster, "quad", lambda s: s.get("checkpoint", {}).get("latest"), "first checkpoint")
    assert running["workers"] == {"ready": 4, "total": 4, "summary": "4/4", "readyPods": 2, "pods": 2}
    pods = job_pods(cluster, "quad")
    assert [p["metadata"]["name"] for p in pods] == ["quad-worker-0", "quad-worker-1"]
    assert pods[1]["spec"]["containers"][0]["command"][:3] == ["tandem", "worker", "launch"]

    os.kill(local_rank_process(cluster.kubelet.pid(NS, "quad-worker-1"), 3), signal.SIGKILL)
    restarted = wait_status(cluster, "quad", lambda s: s.get("restarts") == 1, "restart")
    [why] = [e["message"] for e in cluster.list("events", NS)
             if e["involvedObject"]["name"] == "quad" and e["reason"] == "Restarting"]
    assert why.startswith("rank 3 (pod quad-worker-1, local rank 1) exited with code -9 (killed by SIGKILL)"), why
    first_checkpoint = restarted["checkpoint"]["latest"]

    wait_status(cluster, "quad", lambda s: s.get("phase") == "Running" and s["progress"]["step"] > 40, "progress")
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, JOBS, "quad", {"spec": {"suspend": True}})
    cluster.wait_for(lambda: not job_pods(cluster, "quad"), STARTUP, "all four ranks to stop")
    suspended = job_status(cluster, "quad")
    assert suspended["phase"] == "Suspended"
    assert suspended["checkpoint"]["step"] == suspended["progress"]["step"] > 40, "the ranks' agreed step"
    assert suspended["checkpoint"]["latest"] != first_checkpoint

    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, JOBS, "quad", {"spec": {"suspend": False}})
    final = wait_status(cluster, "quad", lambda s: s.get("phase") == "Succeeded", "success", timeout=180)
    assert final["restarts"] == 1 and final["progress"]["step"] == final["progress"]["totalSteps"]
    assert final["metrics"]["accuracy"] >= 0.9
    resumed = {e["name"]: e.get("value") for e in job_pods(cluster, "quad")[0]["spec"]["containers"][0]["env"]}
    assert resumed["TANDEM_RESUME_FROM"] == suspended["checkpoint"]["latest"]


def test_scaling_to_a_number_pods_cannot_split_is_refused(cluster):
    """`kubectl scale` counts ranks: to 3 ranks in pods of 2 is refused by the API server (the CRD's rule), and the
    job keeps its 4."""
    document = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": "pairs"},
                "spec": {"workers": 4, "ranksPerPod": 2, "trainingMode": "custom",
                         "custom": {"command": ["python", "-c", "import time; time.sleep(600)"]},
                         "trainer": {"model": "tandem.examples.digits:mlp",
                                     "data": "tandem.examples.digits:train_data"}}}
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, document)
    wait_status(cluster, "pairs", lambda s: s.get("phase") == "Running", "Running")
    code, answer = cluster.request("PATCH", f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{JOBS}/pairs/scale",
                                   {"spec": {"replicas": 3}}, "application/merge-patch+json")
    assert code == 422 and "workers must be a multiple of ranksPerPod" in json.dumps(answer), answer
    assert cluster.get("ptj", NS, "pairs")["spec"]["workers"] == 4
    uneven = {**document, "metadata": {"name": "uneven"}, "spec": {**document["spec"], "workers": 3}}
    with pytest.raises(kubernetes.client.ApiException) as refused:
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, uneven)
    assert refused.value.status == 422 and "workers must be a multiple of ranksPerPod" in refused.value.body
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, JOBS, "pairs")
