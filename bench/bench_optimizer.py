"""Optimizer step time: torch's fused implementation (what Tandem builds) against the default, side by side.

    .venv/bin/python bench/bench_optimizer.py [--hidden 512] [--threads 2]

One optimizer step over the digits MLP's parameters with fixed gradients; the best of 5 repeats of 500 steps.
"""

from __future__ import annotations

import argparse
import timeit

import torch

from tandem.examples.digits import mlp

OPTIMIZERS = {
    "SGD, momentum 0.9": lambda params, **kw: torch.optim.SGD(params, lr=0.01, momentum=0.9, **kw),
    "Adam": lambda params, **kw: torch.optim.Adam(params, lr=0.01, **kw),
    "AdamW": lambda params, **kw: torch.optim.AdamW(params, lr=0.01, weight_decay=0.01, **kw),
}


def step_seconds(make, hidden: int, **options) -> float:
    model = mlp(hidden=hidden)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer = make(model.parameters(), **options)
    optimizer.step()
    return min(timeit.repeat(optimizer.step, number=500, repeat=5)) / 500


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"digits MLP hidden={args.hidden}, {args.threads} threads, torch {torch.__version__}")
    for name, make in OPTIMIZERS.items():
        default, fused = step_seconds(make, args.hidden), step_seconds(make, args.hidden, fused=True)
        print(f"{name:18s} default {default * 1e6:7.1f} us | fused {fused * 1e6:7.1f} us | "
              f"fused/default {fused / default:.2f}")


if __name__ == "__main__":
    main()
