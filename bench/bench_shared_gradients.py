"""sharedGradients against allReduce on the digits MLP, side by side in one run (issue 3, benchmark (b)).

    .venv/bin/python bench/bench_shared_gradients.py [--epochs 30] [--seeds 0 1 2]

For each seed, 2 gloo ranks train the digits MLP (SGD lr 0.05, momentum 0.9, batch 32 per rank,
DistributedSampler) three times from the same start: with DDP's own all-reduce; with the sharedGradients hook
(tandem.worker.compression, default settings); and with the hook under DL4J's threshold rule exactly
(max_threshold_growth = 1 / threshold_decay), for reference. It prints the bytes sent, summed over ranks, as a
fraction of what a dense fp32 all-reduce of the same buckets would send, each run's eval accuracy, and the
difference to allReduce. Target: <= 1% of the dense bytes within 1 accuracy point of allReduce.
"""

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

# The training loop and the rank launcher are the tests' own (tests/test_compression.py, tests/distributed.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from distributed import run_on_ranks  # noqa: E402
from test_compression import DIGITS_EPOCHS, train_digits  # noqa: E402

from tandem.api.training import DL4J_THRESHOLD_DECAY  # noqa: E402

TARGET_FRACTION = 0.01
TARGET_POINTS = 1.0


@dataclass
class Outcome:
    accuracy: float
    dense_fraction: float | None


def train(mode: str, epochs: int, seed: int, compression_options: dict | None = None) -> Outcome:
    runs = run_on_ranks(train_digits, mode, epochs, seed, compression_options, world_size=2)
    fraction = None
    if mode == "sharedGradients":
        fraction = sum(run.bytes_sent for run in runs) / sum(run.dense_bytes for run in runs)
    return Outcome(runs[0].accuracy, fraction)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=DIGITS_EPOCHS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()

    dl4j_rule = {"max_threshold_growth": 1 / DL4J_THRESHOLD_DECAY}
    print(f"digits MLP, 2 gloo ranks, {args.epochs} epochs, SGD lr 0.05 momentum 0.9, batch 32/rank")
    fractions, differences = [], []
    for seed in args.seeds:
        dense = train("allReduce", args.epochs, seed)
        shared = train("sharedGradients", args.epochs, seed)
        reference = train("sharedGradients", args.epochs, seed, dl4j_rule)
        difference = 100 * (shared.accuracy - dense.accuracy)
        fractions.append(shared.dense_fraction)
        differences.append(difference)
        print(f"seed {seed}: allReduce accuracy {dense.accuracy:.4f} | sharedGradients accuracy {shared.accuracy:.4f} "
              f"at {shared.dense_fraction:.3%} of dense bytes, {difference:+.2f} points | "
              f"DL4J threshold rule: {reference.accuracy:.4f} at {reference.dense_fraction:.3%}")
    fraction, difference = statistics.mean(fractions), statistics.mean(differences)
    met = fraction <= TARGET_FRACTION and difference >= -TARGET_POINTS
    print(f"mean over {len(args.seeds)} seeds: sharedGradients sends {fraction:.3%} of dense bytes, "
          f"accuracy {difference:+.2f} points against allReduce "
          f"(target <= {TARGET_FRACTION:.0%} within {TARGET_POINTS:.0f} point: {'met' if met else 'not met'})")


if __name__ == "__main__":
    main()
