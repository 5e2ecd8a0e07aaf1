"""The worker contract (tandem/contract.py): the environment a rank reads, and the one a launcher or the operator
writes, are one and the same."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.contract import ContractError, WorkerContract
from tandem.worker.train.process_group import select_device

CONTRACT = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "23456",
            "TANDEM_JOB": "j", "TANDEM_SPEC": "/etc/tandem/spec.json"}


def test_a_rank_reads_the_contract_with_torchruns_defaults():
    env = WorkerContract.from_environ({**CONTRACT, "TANDEM_RESUME_FROM": "/ckpt/step-00000005.pt"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.master_port) == (1, 2, 1, 2, 23456)
    assert env.resume_from == Path("/ckpt/step-00000005.pt") and env.checkpoint_dir is None
    assert env.spec_path == Path("/etc/tandem/spec.json") and env.namespace is None
    assert not env.is_master
    fresh = WorkerContract.from_environ({**CONTRACT, "TANDEM_RESUME_FROM": ""})
    assert fresh.resume_from is None and not fresh.resume_latest
    latest = WorkerContract.from_environ({**CONTRACT, "TANDEM_RESUME_FROM": "latest"})
    assert latest.resume_from is None and latest.resume_latest
    assert latest.to_environ()["TANDEM_RESUME_FROM"] == "latest"


def test_what_a_launcher_writes_is_what_a_rank_reads():
    written = WorkerContract(rank=3, world_size=4, local_rank=1, local_world_size=2, master_addr="job-0.job",
                             master_port=29500, job="job", namespace="ml", spec_path=Path("/etc/tandem/spec.json"),
                             checkpoint_dir=Path("/checkpoints"), resume_from=Path("/checkpoints/step-00000100.pt"))
    environ = written.to_environ()
    assert environ["MASTER_ADDR"] == "job-0.job" and environ["TANDEM_NAMESPACE"] == "ml"
    assert "TANDEM_STATUS_FILE" not in environ
    assert WorkerContract.from_environ(environ) == written
    fresh = WorkerContract.local(0, 2, spec_path=Path("/spec.json")).to_environ()
    assert fresh["TANDEM_RESUME_FROM"] == "" and fresh["LOCAL_RANK"] == "0" and fresh["LOCAL_WORLD_SIZE"] == "2"


@pytest.mark.parametrize(("change", "message"), [
    ({"RANK": None}, "RANK is not set"),
    ({"RANK": "two"}, "RANK='two' is not an integer"),
    ({"RANK": "2"}, "RANK=2 must be in 0..WORLD_SIZE-1"),
    ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=3 must be in 0..LOCAL_WORLD_SIZE-1"),
    ({"TANDEM_SPEC": None}, "TANDEM_SPEC is not set"),
])
def test_contract_errors_name_the_variable(change, message):
    environ = {k: v for k, v in {**CONTRACT, **change}.items() if v is not None}
    with pytest.raises(ContractError, match=message):
        WorkerContract.from_environ(environ)


def test_a_rank_given_no_gpu_trains_on_cpu_even_where_cuda_is_visible():
    assert select_device(WorkerContract.from_environ(CONTRACT), gpus=0, require_gpu=False) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpus_without_cuda_fail_with_require_gpu_and_fall_back_loudly_without(capsys):
    env = WorkerContract.from_environ(CONTRACT)
    with pytest.raises(ContractError, match="requireGPU is true and spec.gpusPerWorker is 1 but CUDA is not"):
        select_device(env, gpus=1, require_gpu=True)
    assert select_device(env, gpus=1, require_gpu=False) == torch.device("cpu")
    assert "warning: spec.gpusPerWorker is 1 but CUDA is not available" in capsys.readouterr().err


def test_a_pod_of_several_ranks_gives_each_its_rank_and_local_rank():
    """The operator writes one contract per pod (GROUP_RANK in place of RANK and LOCAL_RANK); its launcher reads back
    each local rank's, numbered as torchrun numbers them."""
    first = WorkerContract(rank=4, world_size=6, local_rank=0, local_world_size=2, master_addr="job-0.job", job="job",
                           spec_path=Path("/etc/tandem/job.json"))
    environ = first.pod_environ()
    assert environ["GROUP_RANK"] == "2" and "RANK" not in environ and "LOCAL_RANK" not in environ
    ranks = WorkerContract.local_ranks_from_environ(environ)
    assert [(r.rank, r.local_rank, r.local_world_size, r.world_size) for r in ranks] == [(4, 0, 2, 6), (5, 1, 2, 6)]
    assert ranks[0] == first and {r.master_addr for r in ranks} == {"job-0.job"}


@pytest.mark.parametrize(("environ", "message"), [
    ({"GROUP_RANK": "3", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2"}, r"GROUP_RANK=3 must be in 0\.\.2"),
    ({"GROUP_RANK": "0", "WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2"}, "WORLD_SIZE=5 is not a multiple of LOCAL_WORLD"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "GROUP_RANK is not set"),
    ({"GROUP_RANK": "0", "WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE is not set"),
], ids=["pod-beyond-the-group", "uneven-pods", "no-group-rank", "no-local-world-size"])
def test_a_pod_contract_that_cannot_form_names_the_variable(environ, message):
    with pytest.raises(ContractError, match=message):
        WorkerContract.local_ranks_from_environ({**environ, "TANDEM_SPEC": "/spec.json"})
