"""Local ranks for the benchmarks: `run_ranks(fn, *args, workers=2)` calls fn(rank, device, *args) in `workers`
spawned processes joined in one group the way `tandem run` joins them (the worker contract's environment, gloo
on CPU, NCCL with one GPU per rank), and returns rank 0's result, which must be JSON-serialisable."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tandem.contract import WorkerContract
from tandem.worker.cores import share_cores
from tandem.worker.train.process_group import free_port, init_process_group, shutdown_process_group


def run_ranks(fn: Callable[..., Any], *args: Any, workers: int, device_type: str = "cpu") -> Any:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    try:
        mp.start_processes(_rank_main, args=(fn, args, workers, free_port(), device_type, out), nprocs=workers,
                           start_method="spawn")
        return json.loads(out.read_text())
    finally:
        os.unlink(out)


def _rank_main(rank: int, fn, args, workers: int, port: int, device_type: str, out: Path) -> None:
    env = WorkerContract.local(rank, workers, master_port=port)
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    share_cores(env.local_world_size)
    init_process_group(env, device)
    result = fn(rank, device, *args)
    if env.is_master:
        out.write_text(json.dumps(result))
    shutdown_process_group()
