"""The worker contract (env vars set by `tandem run`, the operator, or a person) and process-group setup."""

from __future__ import annotations

import gc
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


class ContractError(RuntimeError):
    """The worker's environment does not satisfy the contract, or the group cannot form."""


@dataclass(frozen=True)
class WorkerEnv:
    """Everything a rank learns from its environment (torchrun's names plus Tandem's)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    job: str
    namespace: str | None
    spec_path: Path
    checkpoint_dir: Path | None
    resume_from: Path | None
    status_file: Path | None

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> WorkerEnv:
        env = dict(os.environ if environ is None else environ)

        def required(name: str) -> str:
            if not env.get(name):
                raise ContractError(f"environment variable {name} is not set (see the worker contract in DESIGN.md)")
            return env[name]

        def integer(name: str, default: str | None = None) -> int:
            text = env.get(name, default) if default is not None else required(name)
            try:
                return int(text)
            except ValueError:
                raise ContractError(f"environment variable {name}={text!r} is not an integer") from None

        rank, world_size = integer("RANK"), integer("WORLD_SIZE")
        if not 0 <= rank < world_size:
            raise ContractError(f"RANK={rank} must be in 0..WORLD_SIZE-1 (WORLD_SIZE={world_size})")
        optional_path = lambda name: Path(env[name]) if env.get(name) else None  # noqa: E731
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=integer("LOCAL_RANK", str(rank)),
            local_world_size=integer("LOCAL_WORLD_SIZE", str(world_size)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=integer("MASTER_PORT", "29500"),
            job=env.get("TANDEM_JOB", "tandem"),
            namespace=env.get("TANDEM_NAMESPACE") or None,
            spec_path=Path(required("TANDEM_SPEC")),
            checkpoint_dir=optional_path("TANDEM_CHECKPOINT_DIR"),
            resume_from=optional_path("TANDEM_RESUME_FROM"),
            status_file=optional_path("TANDEM_STATUS_FILE"),
        )

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def select_device(env: WorkerEnv, *, require_gpu: bool) -> torch.device:
    """One GPU per local rank when CUDA is present; CPU otherwise, unless the job requires a GPU."""
    if torch.cuda.is_available():
        if env.local_rank >= torch.cuda.device_count():
            raise ContractError(
                f"LOCAL_RANK={env.local_rank} but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    if require_gpu:
        raise ContractError(
            "trainer.requireGPU is true but CUDA is not available in this worker "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); refusing to train on CPU"
        )
    return torch.device("cpu")


def share_cpu_threads(env: WorkerEnv) -> None:
    """Ranks on one machine split its cores instead of each starting a thread per core."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))


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


def init_process_group(env: WorkerEnv, device: torch.device, *, timeout: float = 300.0) -> None:
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


def shutdown_process_group() -> None:
    """Leave the group so that no gloo thread outlives it.

    Collectives on Python-owned tensors leave references that gloo's worker threads release late; if one
    survives to interpreter teardown the process aborts ("terminate called without an active exception",
    pytorch/pytorch#179291). Collect them first, then destroy the group.
    """
    gc.collect()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
