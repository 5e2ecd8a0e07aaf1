"""Trainer throughput, measured side by side in one run.

(a) Tandem's allReduce loop against a plain hand-written DDP loop: same model, data, batch and ranks.
(c) Tandem's samples/s with 1 and 2 ranks.

    .venv/bin/python bench/bench_trainer.py [--steps 300] [--hidden 512] [--batch 64] [--rounds 8] [--prefetch N]

Both loops are timed by the same clock on rank 0 from the end of warm-up step to the last step, so
start-up, evaluation and the final checkpoint are outside the measurement. Both loops run in the same rank
processes, round after round, alternating which goes first; the median over rounds is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from tandem.api import ParallelTrainingJobSpec
from tandem.examples.digits import mlp, train_data
from tandem.worker.data import training_loader
from tandem.worker.distributed import (
    WorkerEnv,
    free_port,
    init_process_group,
    share_cpu_threads,
    shutdown_process_group,
)
from tandem.worker.trainer import RankContext, train

WARMUP_STEPS = 20


def _spec(args, workers: int) -> ParallelTrainingJobSpec:
    return ParallelTrainingJobSpec.model_validate({
        "workers": workers,
        "trainer": {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data",
                    "modelArgs": {"hidden": args.hidden}, "batchSizePerWorker": args.batch,
                    "maxSteps": args.steps, "epochs": 10_000, "optimizer": {"name": "sgd", "lr": 0.01},
                    **({"prefetchBuffer": args.prefetch} if args.prefetch is not None else {})},
        "checkpoint": {"directory": tempfile.mkdtemp(prefix="tandem-bench-")},
    })


def _tandem(rank: int, args, workers: int) -> float:
    """Tandem's training loop (trainer.train, what `tandem run` runs); samples/s."""
    spec = _spec(args, workers)
    marks: dict[int, float] = {}
    context = RankContext(rank=rank, world_size=workers, device=torch.device("cpu"), job="bench",
                          checkpoint_dir=Path(spec.checkpoint.directory),
                          listeners=[lambda step, model, synced: marks.__setitem__(step, time.perf_counter())])
    train(spec, context, mlp(hidden=args.hidden), train_data(), None)
    return _rate(marks, args, workers)


def _plain_ddp(rank: int, args, workers: int) -> float:
    """The loop a person writes from the DDP tutorial; samples/s."""
    torch.manual_seed(0)
    model = DistributedDataParallel(mlp(hidden=args.hidden))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = training_loader(train_data(), rank=rank, world_size=workers, batch_size=args.batch, seed=0)
    marks: dict[int, float] = {}
    step, epoch = 0, 0
    while step < args.steps:
        loader.sampler.set_epoch(epoch)
        for inputs, targets in loader:
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            marks[step] = time.perf_counter()
            if step == args.steps:
                break
        epoch += 1
    return _rate(marks, args, workers)


def _rate(marks: dict[int, float], args, workers: int) -> float:
    return (args.steps - WARMUP_STEPS) * args.batch * workers / (marks[args.steps] - marks[WARMUP_STEPS])


LOOPS = {"tandem": _tandem, "plain": _plain_ddp}


def _rank(rank: int, args, workers: int, port: int, names: list[str], out: Path) -> None:
    """Every round runs each loop once in these same processes (alternating which goes first), so both
    loops see the same process placement, memory and machine load; rank 0 keeps the figures."""
    env = WorkerEnv.from_environ({"RANK": str(rank), "WORLD_SIZE": str(workers), "MASTER_PORT": str(port),
                                  "TANDEM_SPEC": "(bench)"})
    share_cpu_threads(env)
    init_process_group(env, torch.device("cpu"))
    figures: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            figures[name].append(LOOPS[name](rank, args, workers))
    if env.is_master:
        out.write_text(json.dumps(figures))
    shutdown_process_group()


def measure(names: list[str], args, workers: int) -> dict[str, float]:
    """Median samples/s of each named loop on `workers` ranks."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    mp.start_processes(_rank, args=(args, workers, free_port(), names, out), nprocs=workers, start_method="spawn")
    figures = json.loads(out.read_text())
    os.unlink(out)
    return {name: statistics.median(values) for name, values in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prefetch", type=int, help="trainer.prefetchBuffer (default: the API's default)")
    args = parser.parse_args()

    two = measure(["tandem", "plain"], args, 2)
    one = measure(["tandem"], args, 1)
    t, p, o = two["tandem"], two["plain"], one["tandem"]
    print(f"digits MLP hidden={args.hidden}, batch {args.batch}/rank, {args.steps} steps, "
          f"median of {args.rounds} rounds, {os.cpu_count()} CPUs, gloo")
    print(f"(a) allReduce, 2 ranks: tandem {t:,.0f} samples/s | plain DDP loop {p:,.0f} samples/s | "
          f"ratio {t / p:.3f} (target >= 0.97)")
    print(f"(c) tandem allReduce: 1 rank {o:,.0f} samples/s | 2 ranks {t:,.0f} samples/s | "
          f"scaling {t / o:.2f}x")


if __name__ == "__main__":
    main()
