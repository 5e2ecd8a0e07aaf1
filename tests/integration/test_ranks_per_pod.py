"""Several ranks in one pod (spec.ranksPerPod), the worker's side: the pod's launcher (`tandem worker launch`) run as
a pod runs it, by hand, with the environment the operator writes (WorkerContract.pod_environ). The operator's side,
on the emulated cluster, is in test_operator.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from jobs import TESTS, final_weights, leftover_processes, manifest, tandem_run

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


KILLED = """
    import os, resource, signal, time
    if os.environ["LOCAL_RANK"] == "1":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
        print("rank 3 is going down", flush=True)
        os.kill(os.getpid(), signal.{signal})
    time.sleep(120)
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV], ids=["oom-killed", "segfault"])
def test_a_local_rank_killed_by_a_signal_ends_the_pod_with_128_plus_the_signal(tmp_path, signum):
    """As a shell reports a signal, and the kubelet a container killed by one (137 for an OOM kill). The sibling,
    asleep for 2 minutes, is killed, not waited for."""
    job = custom_job(tmp_path, "killed", KILLED.format(signal=signum.name))
    message = tmp_path / "termination-log"
    pod = start_pod(job, 1, 2, 4, 29514, termination_log=message)
    assert pod.wait(timeout=60) == 128 + signum
    assert not leftover_processes("killed"), "a sibling rank outlived its pod"
    head, *tail = message.read_text().splitlines()
    assert head == f"rank 3 (local rank 1) exited with code {-signum} (killed by {signum.name})"
    assert tail == ["rank 3 is going down"]


LONG_LOG = """
    import os, time
    if os.environ["LOCAL_RANK"] == "1":
        for line in range(100):
            print(f"line {line:03} " + "é" * 300, flush=True)
        raise RuntimeError("rank 3's last words")
    time.sleep(120)
"""


def test_the_termination_message_of_a_long_log_keeps_its_end_within_4096_bytes(tmp_path):
    """A rank that logs about 60 KB (the message is built from its last 30 lines: about 16 KB), then a traceback:
    the message is the cause and as much of the log's end as fits the kubelet's 4,096 bytes, the traceback whole, no
    character cut in half (each "é" is 2 bytes: one the limit cuts is dropped whole)."""
    job = custom_job(tmp_path, "long-log", LONG_LOG)
    message = tmp_path / "termination-log"
    pod = start_pod(job, 1, 2, 4, 29515, termination_log=message)
    assert pod.wait(timeout=60) == 1
    written = message.read_bytes()
    assert 4096 - 1 <= len(written) <= 4096
    head, *tail = written.decode().splitlines()
    assert head == "rank 3 (local rank 1) exited with code 1"
    assert tail[-4:] == ["Traceback (most recent call last):",
                         f'  File "{tmp_path / "long-log.py"}", line 6, in <module>',
                         "    raise RuntimeError(\"rank 3's last words\")", "RuntimeError: rank 3's last words"]
    assert tail[-5] == "line 099 " + "é" * 300


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
