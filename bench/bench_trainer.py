"""Trainer throughput, measured side by side in one run.

(a) Tandem's allReduce loop against a plain hand-written DDP loop: same model, data, batch and ranks.
(c) Tandem's samples/s with 1 and 2 ranks.

    .venv/bin/python bench/bench_trainer.py [--steps 300] [--hidden 512] [--batch 64] [--rounds 3] [--prefetch N]

Both loops are timed by the same clock on rank 0 from the end of warm-up step to the last step, so
start-up, evaluation and the final checkpoint are outside the measurement. Each round runs every loop,
in an order rotated from round to round (the first run of a round measured slower), and the median over
rounds is reported.
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
PAUSE_SECONDS = 2.0


def _spec(args, workers: int) -> ParallelTrainingJobSpec:
    return ParallelTrainingJobSpec.model_validate({
        "workers": workers,
        "trainer": {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data",
                    "modelArgs": {"hidden": args.hidden}, "batchSizePerWorker": args.batch,
                    "maxSteps": args.steps, "epochs": 10_000, "optimizer": {"name": "sgd", "lr": 0.01},
                    **({"prefetchBuffer": args.prefetch} if args.prefetch is not None else {})},
        "checkpoint": {"directory": tempfile.mkdtemp(prefix="tandem-bench-")},
    })


def _tandem(rank: int, args, workers: int, port: int, out: Path) -> None:
    env = _join(rank, workers, port)
    spec = _spec(args, workers)
    marks: dict[int, float] = {}
    context = RankContext(rank=rank, world_size=workers, device=torch.device("cpu"), job="bench",
                          checkpoint_dir=Path(spec.checkpoint.directory),
                          listeners=[lambda step, model, synced: marks.__setitem__(step, time.perf_counter())])
    train(spec, context, mlp(hidden=args.hidden), train_data(), None)
    _report(env, marks, args, workers, out)


def _plain_ddp(rank: int, args, workers: int, port: int, out: Path) -> None:
    """The loop a person writes from the DDP tutorial."""
    env = _join(rank, workers, port)
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
    _report(env, marks, args, workers, out)


def _join(rank: int, workers: int, port: int) -> WorkerEnv:
    env = WorkerEnv.from_environ({"RANK": str(rank), "WORLD_SIZE": str(workers), "MASTER_PORT": str(port),
                                  "TANDEM_SPEC": "(bench)"})
    share_cpu_threads(env)
    init_process_group(env, torch.device("cpu"))
    return env


def _report(env: WorkerEnv, marks: dict[int, float], args, workers: int, out: Path) -> None:
    if env.is_master:
        seconds = marks[args.steps] - marks[WARMUP_STEPS]
        samples = (args.steps - WARMUP_STEPS) * args.batch * workers
        out.write_text(json.dumps({"samples_per_second": samples / seconds}))
    shutdown_process_group()


def measure(loop, args, workers: int) -> float:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    mp.start_processes(loop, args=(args, workers, free_port(), out), nprocs=workers, start_method="spawn")
    result = json.loads(out.read_text())["samples_per_second"]
    os.unlink(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefetch", type=int, help="trainer.prefetchBuffer (default: the API's default)")
    args = parser.parse_args()

    runs = {"tandem": (_tandem, 2), "plain": (_plain_ddp, 2), "one rank": (_tandem, 1)}
    figures: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(args.rounds):
        names = list(runs)
        names = names[round_index % len(names):] + names[:round_index % len(names)]  # no loop always goes first
        for name in names:
            loop, workers = runs[name]
            time.sleep(PAUSE_SECONDS)  # let the previous run's processes finish leaving
            figures[name].append(measure(loop, args, workers))
    t, p, o = (statistics.median(figures[name]) for name in runs)
    print(f"digits MLP hidden={args.hidden}, batch {args.batch}/rank, {args.steps} steps, "
          f"median of {args.rounds} rounds, {os.cpu_count()} CPUs, gloo")
    print(f"(a) allReduce, 2 ranks: tandem {t:,.0f} samples/s | plain DDP loop {p:,.0f} samples/s | "
          f"ratio {t / p:.3f} (target >= 0.97)")
    print(f"(c) tandem allReduce: 1 rank {o:,.0f} samples/s | 2 ranks {t:,.0f} samples/s | "
          f"scaling {t / o:.2f}x")


if __name__ == "__main__":
    main()
