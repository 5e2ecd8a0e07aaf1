"""Joining a rank to its job's process group, as the worker contract (tandem/contract.py) describes it, and leaving
it cleanly."""

from __future__ import annotations

import gc
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.api import ParallelTrainingJobSpec
from tandem.contract import ContractError, WorkerContract
from tandem.worker.cores import share_cores
from tandem.worker.train.membership import Membership

GROUP_TIMEOUT_SECONDS = 300.0
"""How long a rank waits for the master's port, and a collective for its peers."""


def select_device(env: WorkerContract, *, gpus: int, require_gpu: bool) -> torch.device:
    """The GPU of this local rank (cuda:LOCAL_RANK) when the job gives its ranks GPUs (spec.gpusPerWorker > 0);
    the CPU when it gives none. Given GPUs but no CUDA: an error with requireGPU, else the CPU and a warning."""
    if gpus > 0 and torch.cuda.is_available():
        if env.local_rank >= torch.cuda.device_count():
            raise ContractError(
                f"LOCAL_RANK={env.local_rank} but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    if gpus > 0:
        why = (f"spec.gpusPerWorker is {gpus} but CUDA is not available in this worker "
               f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})")
        if require_gpu:
            raise ContractError(f"trainer.requireGPU is true and {why}; refusing to train on CPU")
        print(f"tandem worker: warning: {why}; training on CPU", file=sys.stderr, flush=True)
    return torch.device("cpu")


def wait_for_master(addr: str, port: int, timeout: float) -> None:
    """Block until the master's TCP port accepts connections (not just until its name resolves)."""
    deadline = time.monotonic() + timeout
    last_error: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=2):
                return
        except OSError as error:
            last_error = error
            time.sleep(0.2)
    raise ContractError(f"master {addr}:{port} did not accept connections within {timeout:.0f}s ({last_error})")


def backend_for(device: torch.device) -> str:
    """gloo on CPU. On CUDA, NCCL for the model's tensors and gloo for the small CPU tensors the ranks exchange
    besides (stop requests, byte counts, evaluation totals), which NCCL alone would refuse."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_process_group(env: WorkerContract, device: torch.device, *, timeout: float = GROUP_TIMEOUT_SECONDS) -> None:
    """Join the job's group (see backend_for). Rank 0 hosts the TCP store; the others wait for its port first."""
    if not env.is_master:
        wait_for_master(env.master_addr, env.master_port, timeout)
    dist.init_process_group(
        backend=backend_for(device),
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout),
        device_id=device if device.type == "cuda" else None,
    )


def join_group(env: WorkerContract, *, gpus: int = 0, require_gpu: bool = False) -> torch.device:
    """Everything a rank does before training: take its share of the machine's cores, its device (one GPU per
    local rank), and its place in the group. Returns the device."""
    device = take_device(env, gpus=gpus, require_gpu=require_gpu)
    init_process_group(env, device)
    return device


def take_device(env: WorkerContract, *, gpus: int, require_gpu: bool) -> torch.device:
    """This rank's share of the machine's cores, and its device (one GPU per local rank)."""
    share_cores(env.local_world_size)
    return select_device(env, gpus=gpus, require_gpu=require_gpu)


def join_elastic_group(env: WorkerContract, spec: ParallelTrainingJobSpec) -> tuple[torch.device, Membership]:
    """join_group for an elastic job's rank: its place in the job (its slot, on the store of the job's coordinator at
    MASTER_ADDR:MASTER_PORT, membership.py), its first generation formed when training starts (`Membership.start`,
    from `train`)."""
    device = take_device(env, gpus=spec.gpus_per_worker, require_gpu=spec.trainer.require_gpu)
    wait_for_master(env.master_addr, env.master_port, GROUP_TIMEOUT_SECONDS)
    membership = Membership(slot=env.rank, addr=env.master_addr, port=env.master_port, backend=backend_for(device),
                            deadline_seconds=spec.elastic.regroup_deadline_seconds,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_SECONDS))
    return device, membership


def shutdown_process_group() -> None:
    """Leave the group so that no gloo thread outlives it.

    Collectives on Python-owned tensors leave references that gloo's worker threads release late; if one
    survives to interpreter teardown the process aborts ("terminate called without an active exception",
    pytorch/pytorch#179291). Collect them first, then destroy the group.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
