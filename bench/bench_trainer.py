"""Trainer throughput, measured side by side in one run.

(a) Tandem's allReduce loop against a plain hand-written DDP loop: same model, data, batch and ranks (2, then 1).
(c) Tandem's samples/s with 1 and 2 ranks.

    .venv/bin/python bench/bench_trainer.py [--steps 300] [--hidden 512] [--batch 64] [--rounds 24] [--prefetch N]
                                            [--device cuda]

The loops are timed by the same clock on rank 0 from the end of the warm-up steps to the last step, so
start-up, evaluation and the final checkpoint are outside the measurement. They run in the same rank
processes, round after round, rotating which goes first; a ratio is the median of the per-round ratios,
which cancels the machine's drift between rounds (whole runs move 10-20% on a shared VM).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from ranks import run_ranks
from torch.nn.parallel import DistributedDataParallel

from tandem.api import ParallelTrainingJobSpec
from tandem.examples.digits import mlp, train_data
from tandem.worker.train.data import training_loader
from tandem.worker.train.trainer import RankContext, train

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


class Clock:
    """Times the steps after WARMUP_STEPS up to the last; on a GPU it waits for the device at those two marks
    only, so the loops run as they would unobserved."""

    def __init__(self, args, workers: int, device: torch.device):
        self.steps, self.samples_per_step, self.device = args.steps, args.batch * workers, device
        self.times: dict[int, float] = {}

    def mark(self, step: int) -> None:
        if step in (WARMUP_STEPS, self.steps):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.times[step] = time.perf_counter()

    def samples_per_second(self) -> float:
        return (self.steps - WARMUP_STEPS) * self.samples_per_step / (self.times[self.steps] - self.times[WARMUP_STEPS])


def _tandem(rank: int, args, workers: int, device: torch.device) -> float:
    """Tandem's training loop (trainer.train, what `tandem run` runs); samples/s."""
    spec = _spec(args, workers)
    clock = Clock(args, workers, device)
    context = RankContext(rank=rank, world_size=workers, device=device, job="bench",
                          checkpoint_dir=Path(spec.checkpoint.directory),
                          listeners=[lambda step, model, optimizer, synced: clock.mark(step)])
    train(spec, context, mlp(hidden=args.hidden), train_data(), None)
    return clock.samples_per_second()


def _plain_ddp(rank: int, args, workers: int, device: torch.device, tuned: bool = False) -> float:
    """The loop a person writes from the DDP tutorial; samples/s. `tuned`: with the torch settings Tandem picks
    (DDP's gradient_as_bucket_view, the fused optimizer), which leaves Tandem's own per-step work as the
    difference."""
    torch.manual_seed(0)
    device_ids = [device.index] if device.type == "cuda" else None
    model = DistributedDataParallel(mlp(hidden=args.hidden).to(device), device_ids=device_ids,
                                    gradient_as_bucket_view=tuned)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=tuned)
    loader = training_loader(train_data(), rank=rank, world_size=workers, batch_size=args.batch, seed=0)
    clock = Clock(args, workers, device)
    step, epoch = 0, 0
    while step < args.steps:
        loader.sampler.set_epoch(epoch)
        for inputs, targets in loader:
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            clock.mark(step)
            if step == args.steps:
                break
        epoch += 1
    return clock.samples_per_second()


def _plain_ddp_tuned(rank: int, args, workers: int, device: torch.device) -> float:
    return _plain_ddp(rank, args, workers, device, tuned=True)


LOOPS = {"tandem": _tandem, "plain": _plain_ddp, "tuned": _plain_ddp_tuned}


def _rounds(rank: int, device: torch.device, names: list[str], args, workers: int) -> dict[str, list[float]]:
    """Every round runs each loop once in these same processes (rotating which goes first), so the loops see
    the same process placement, memory and machine load."""
    figures: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        first = round_index % len(names)
        for name in names[first:] + names[:first]:
            figures[name].append(LOOPS[name](rank, args, workers, device))
    return figures


def measure(names: list[str], args, workers: int) -> dict[str, list[float]]:
    """Samples/s of each named loop on `workers` ranks, one figure per round."""
    return run_ranks(_rounds, names, args, workers, workers=workers, device_type=args.device)


def paired_ratio(numerators: list[float], denominators: list[float]) -> str:
    """Median of the per-round ratios, with their quartiles: the machine's drift between rounds cancels."""
    ratios = [a / b for a, b in zip(numerators, denominators, strict=True)]
    if len(ratios) < 2:
        return f"{ratios[0]:.3f} (one round)"
    low, _, high = statistics.quantiles(ratios, n=4)
    return f"{statistics.median(ratios):.3f} (quartiles {low:.3f}-{high:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--prefetch", type=int, help="trainer.prefetchBuffer (default: the API's default)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one rank per GPU with NCCL (2 ranks when 2 GPUs are visible, else 1)")
    args = parser.parse_args()
    rank_counts = (2, 1) if args.device == "cpu" or torch.cuda.device_count() >= 2 else (1,)

    print(f"digits MLP hidden={args.hidden}, batch {args.batch}/rank, {args.steps} steps, "
          f"{args.rounds} rounds (medians), {os.cpu_count()} CPUs, "
          f"{torch.cuda.get_device_name() + ', NCCL' if args.device == 'cuda' else 'gloo'}")
    rates = {}
    for workers in rank_counts:
        figures = measure(["tandem", "plain", "tuned"], args, workers)
        rates[workers] = statistics.median(figures["tandem"])
        plain, tuned = statistics.median(figures["plain"]), statistics.median(figures["tuned"])
        print(f"(a) allReduce, {workers} rank{'s' if workers > 1 else ''}: tandem {rates[workers]:,.0f} samples/s | "
              f"plain DDP loop {plain:,.0f} samples/s | ratio {paired_ratio(figures['tandem'], figures['plain'])} "
              f"(target >= 0.97)")
        print(f"    against the plain loop with Tandem's torch settings ({tuned:,.0f} samples/s): "
              f"ratio {paired_ratio(figures['tandem'], figures['tuned'])}")
    if 2 in rates:
        print(f"(c) tandem allReduce: 1 rank {rates[1]:,.0f} samples/s | 2 ranks {rates[2]:,.0f} samples/s | "
              f"scaling {rates[2] / rates[1]:.2f}x")


if __name__ == "__main__":
    main()
