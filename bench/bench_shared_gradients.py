"""sharedGradients against allReduce on the digits MLP, side by side in one run (issue 3, benchmark (b)).

    .venv/bin/python bench/bench_shared_gradients.py [--epochs 30] [--seeds 0 1 2]

For each seed, 2 gloo ranks run Tandem's trainer (what `tandem run` runs) on examples/digits-train-shared.yaml
three times from the same initial weights: with trainingMode allReduce (DDP's own all-reduce); with
sharedGradients as the example sets it; and with the hook under DL4J's threshold rule exactly
(max_threshold_growth = 1 / threshold_decay, a setting of the hook that the API does not expose), for
reference. It prints the bytes sent, summed over ranks, as a fraction of what a dense fp32 all-reduce of the same
buckets would send (the status's communication.bytesSent / denseBytes), each run's eval accuracy, and the
difference to allReduce. Target: <= 1% of the dense bytes within 1 accuracy point of allReduce.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
from pathlib import Path

import torch
import yaml
from ranks import run_ranks

from tandem.api import ParallelTrainingJobSpec
from tandem.api.training import DL4J_THRESHOLD_DECAY
from tandem.examples.digits import eval_data, mlp, train_data
from tandem.worker.train import compression
from tandem.worker.train.trainer import RankContext, train

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits-train-shared.yaml"
TARGET_FRACTION = 0.01
TARGET_POINTS = 1.0


def _train(rank: int, device: torch.device, mode: str, epochs: int, seed: int, dl4j_rule: bool) -> dict:
    """One run of the example in `mode`; rank 0 returns the eval accuracy and the byte counts."""
    document = yaml.safe_load(EXAMPLE.read_text())["spec"]
    document["trainingMode"] = mode
    document["trainer"].update(epochs=epochs, seed=seed)
    document["checkpoint"] = {"directory": tempfile.mkdtemp(prefix="tandem-bench-"), "resume": False}
    spec = ParallelTrainingJobSpec.model_validate(document)
    if dl4j_rule:
        compression.ThresholdCompression = functools.partial(
            compression.ThresholdCompression, max_threshold_growth=1 / DL4J_THRESHOLD_DECAY
        )
    torch.manual_seed(seed)
    model = mlp()
    context = RankContext(rank=rank, world_size=spec.workers, device=device, job="bench",
                          checkpoint_dir=Path(spec.checkpoint.directory))
    status = train(spec, context, model, train_data(), eval_data())
    if status is None:
        return {}
    return {"accuracy": status.metrics["accuracy"], "bytesSent": status.communication.bytes_sent,
            "denseBytes": status.communication.dense_bytes}


def run(mode: str, epochs: int, seed: int, dl4j_rule: bool = False) -> dict:
    return run_ranks(_train, mode, epochs, seed, dl4j_rule, workers=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=yaml.safe_load(EXAMPLE.read_text())["spec"]["trainer"]["epochs"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()

    print(f"examples/{EXAMPLE.name} (digits MLP, SGD lr 0.05 momentum 0.9, batch 32/rank), 2 gloo ranks, "
          f"{args.epochs} epochs")
    fractions, differences = [], []
    for seed in args.seeds:
        dense = run("allReduce", args.epochs, seed)
        shared = run("sharedGradients", args.epochs, seed)
        reference = run("sharedGradients", args.epochs, seed, dl4j_rule=True)
        fraction = shared["bytesSent"] / shared["denseBytes"]
        difference = 100 * (shared["accuracy"] - dense["accuracy"])
        fractions.append(fraction)
        differences.append(difference)
        print(f"seed {seed}: allReduce accuracy {dense['accuracy']:.4f} | sharedGradients accuracy "
              f"{shared['accuracy']:.4f} at {fraction:.3%} of dense bytes, {difference:+.2f} points | "
              f"DL4J threshold rule: {reference['accuracy']:.4f} at "
              f"{reference['bytesSent'] / reference['denseBytes']:.3%}")
    fraction, difference = statistics.mean(fractions), statistics.mean(differences)
    met = fraction <= TARGET_FRACTION and difference >= -TARGET_POINTS
    print(f"mean over {len(args.seeds)} seeds: sharedGradients sends {fraction:.3%} of dense bytes, "
          f"accuracy {difference:+.2f} points against allReduce "
          f"(target <= {TARGET_FRACTION:.0%} within {TARGET_POINTS:.0f} point: {'met' if met else 'not met'})")


if __name__ == "__main__":
    main()
