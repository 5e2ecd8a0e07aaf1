"""sharedGradients against allReduce, side by side from the same initial weights (issues 3 and 13).

    .venv/bin/python bench/bench_shared_gradients.py                      # the defaults and DL4J's algorithm
    .venv/bin/python bench/bench_shared_gradients.py --variants ablation  # every technique off (or on) alone

For each model, budget (epochs) and seed, 2 gloo ranks run Tandem's trainer (what `tandem run` runs) with
trainingMode allReduce and then with sharedGradients under each variant of spec.sharedGradients, every run from
the same initial weights and data order. Models: the digits MLP of examples/digits-train-shared.yaml (64-128-128-10,
26,122 parameters) and the small CNN on the same digits as 1x8x8 images (tandem.examples.digits:cnn, two 3x3
convolutions with batch norm, 10,138 parameters); both SGD lr 0.05 momentum 0.9, batch 32 per rank. It prints
each run's eval accuracy, its difference to allReduce in points, and the bytes sent summed over ranks as a
fraction of what a dense fp32 all-reduce of the same buckets sends (the status's communication.bytesSent /
denseBytes), then a markdown table of the means over seeds. Targets (issue 13): within 1 point of allReduce at
both budgets, at <= 1% of the dense bytes at 10 epochs and <= 0.15% at 30.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from ranks import run_ranks

from tandem.api import ParallelTrainingJobSpec
from tandem.examples.digits import cnn, eval_data, mlp, train_data
from tandem.worker.train.trainer import RankContext, train

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits-train-shared.yaml"
TARGET_POINTS = 1.0
TARGET_FRACTION = {10: 0.01, 30: 0.0015}

DL4J = {"calibration": "off", "targetSparsity": {"min": 1e-4, "max": 1e-2},
        "momentumCorrection": {"enabled": False}, "warmup": {"steps": 0}}
"""DL4J's algorithm (with the faster threshold climb the hook has had since issue 3)."""

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "DL4J": DL4J,
    # Ablation: each technique alone off (or on) against the defaults.
    "no momentum correction": {"momentumCorrection": {"enabled": False}},
    "momentum correction with the optimizer's momentum (DGC)": {"momentumCorrection": {"momentum": None}},
    "+ momentum factor masking": {"momentumCorrection": {"masking": True}},
    "DGC's momentum and masking": {"momentumCorrection": {"momentum": None, "masking": True}},
    "one shared threshold (calibration shared)": {"calibration": "shared"},
    "no calibration": {"calibration": "off"},
    "+ warm-up (25 steps from 1/16)": {"warmup": {"steps": 25}},
    "DL4J's band (1e-4..1e-2)": {"targetSparsity": {"min": 1e-4, "max": 1e-2}},
    "no residual clipping": {"residualClip": {"factor": 1e6}},
    "+ local gradient clipping (1.0)": {"localGradientClip": 1.0},
}
GROUPS = {"main": ["default", "DL4J"], "ablation": list(VARIANTS)}

MODELS = {
    "mlp": {"model": "tandem.examples.digits:mlp", "dataArgs": {}},
    "cnn": {"model": "tandem.examples.digits:cnn", "dataArgs": {"image": True}},
}


def merged(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _train(rank: int, device: torch.device, model_name: str, mode: str, shared: dict[str, Any], epochs: int,
           seed: int) -> dict:
    """One run; rank 0 returns the eval accuracy, the byte counts and the status's compression report."""
    document = yaml.safe_load(EXAMPLE.read_text())["spec"]
    document["trainingMode"] = mode
    document["sharedGradients"] = merged(document.get("sharedGradients", {}), shared)
    document["trainer"].update(epochs=epochs, seed=seed, **MODELS[model_name])
    document["checkpoint"] = {"directory": tempfile.mkdtemp(prefix="tandem-bench-"), "resume": False}
    spec = ParallelTrainingJobSpec.model_validate(document)
    image = bool(spec.trainer.data_args.get("image"))
    torch.manual_seed(seed)
    model = mlp() if model_name == "mlp" else cnn()
    context = RankContext(rank=rank, world_size=spec.workers, device=device, job="bench",
                          checkpoint_dir=Path(spec.checkpoint.directory))
    status = train(spec, context, model, train_data(image=image), eval_data(image=image))
    if status is None:
        return {}
    communication = status.communication
    return {"accuracy": status.metrics["accuracy"], "bytesSent": communication.bytes_sent,
            "denseBytes": communication.dense_bytes, "sentFraction": communication.sent_fraction,
            "bitmapSteps": communication.bitmap_steps, "threshold": communication.threshold,
            "steps": status.progress.step}


def run(model_name: str, mode: str, shared: dict[str, Any], epochs: int, seed: int) -> dict:
    return run_ranks(_train, model_name, mode, shared, epochs, seed, workers=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, nargs="+", default=[10, 30])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--variants", nargs="+", default=["main"],
                        help=f"names from {list(VARIANTS)}, or the groups {list(GROUPS)}")
    args = parser.parse_args()
    variants = [name for choice in args.variants for name in GROUPS.get(choice, [choice])]
    for name in variants:
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r}")

    print(f"2 gloo ranks, SGD lr 0.05 momentum 0.9, batch 32 per rank, seeds {args.seeds}", flush=True)
    started = time.monotonic()
    rows: list[tuple[str, str, int, float, float, float, int, int]] = []
    for model_name in args.models:
        for epochs in args.epochs:
            dense = {seed: run(model_name, "allReduce", {}, epochs, seed) for seed in args.seeds}
            accuracies = " / ".join(f"{dense[seed]['accuracy']:.4f}" for seed in args.seeds)
            print(f"{model_name} {epochs} epochs: allReduce accuracy {accuracies}", flush=True)
            for name in variants:
                differences, fractions, sent, bitmaps = [], [], [], []
                for seed in args.seeds:
                    result = run(model_name, "sharedGradients", VARIANTS[name], epochs, seed)
                    difference = 100 * (result["accuracy"] - dense[seed]["accuracy"])
                    fraction = result["bytesSent"] / result["denseBytes"]
                    differences.append(difference)
                    fractions.append(fraction)
                    sent.append(result["sentFraction"])
                    bitmaps.append(result["bitmapSteps"])
                    print(f"  {name}, seed {seed}: accuracy {result['accuracy']:.4f} ({difference:+.2f} points) at "
                          f"{fraction:.3%} of dense bytes; entries sent {result['sentFraction']:.3%}, "
                          f"{result['bitmapSteps']} bitmap steps of {result['steps']}, final threshold "
                          f"{result['threshold']:.3g}", flush=True)
                rows.append((model_name, name, epochs, statistics.mean(differences), min(differences),
                             statistics.mean(fractions), statistics.mean(sent), round(statistics.mean(bitmaps))))
    print(f"\n{time.monotonic() - started:.0f} s\n")
    print("| model | variant | epochs | accuracy vs allReduce (mean, worst seed) | bytes, % of dense | entries sent "
          "| bitmap steps | targets |")
    print("|---|---|---|---|---|---|---|---|")
    for model_name, name, epochs, difference, worst, fraction, sent, bitmaps in rows:
        target = TARGET_FRACTION.get(epochs)
        met = "" if target is None else (
            "met" if difference >= -TARGET_POINTS and fraction <= target else "not met")
        print(f"| {model_name} | {name} | {epochs} | {difference:+.2f} ({worst:+.2f}) | {fraction:.3%} | {sent:.3%} "
              f"| {bitmaps} | {met} |")


if __name__ == "__main__":
    main()
