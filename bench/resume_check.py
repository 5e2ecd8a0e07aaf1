"""Exact resume on this machine's device, through `tandem run` as a user resumes: 2N steps straight against N steps,
a stop, and the same command again, with a model that draws random numbers (the digits MLP with dropout) and
`deterministic: true`. Prints whether the final weights are bit-identical. The suite checks this on CPU
(tests/integration/test_resume.py); this is the check for a GPU (cuda RNG state, cuBLAS in deterministic mode).

    .venv/bin/python bench/resume_check.py                  # CPU, 2 ranks
    python3 bench/resume_check.py --device cuda --workers 1  # one rank per GPU (bench/device_check.sh runs it)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from tandem.worker import checkpoint


def manifest(directory: Path, name: str, steps: int, warmup: int, workers: int, gpus: int) -> Path:
    document = {
        "apiVersion": "tandem.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": name},
        "spec": {
            "workers": workers, "gpusPerWorker": gpus,
            "trainer": {"model": "tandem.examples.digits:mlp", "modelArgs": {"hidden": 256, "dropout": 0.3},
                        "data": "tandem.examples.digits:train_data", "batchSizePerWorker": 32, "epochs": 100,
                        "maxSteps": steps, "deterministic": True, "requireGPU": gpus > 0,
                        "optimizer": {"name": "adamw", "lr": 0.001}, "lrWarmupSteps": warmup},
            "checkpoint": {"directory": str(directory / name)},
        },
    }
    path = directory / f"{name}-{steps}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def tandem_run(path: Path) -> dict:
    result = subprocess.run([sys.executable, "-m", "tandem.cli", "run", str(path), "-o", "json"], capture_output=True,
                            text=True)
    if result.returncode != 0:
        sys.exit(f"tandem run {path.name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="N: the stop falls after N of 2N steps")
    args = parser.parse_args()
    gpus = 1 if args.device == "cuda" else 0
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        warmup = args.steps + 10  # the stop falls inside the learning-rate warm-up
        straight = tandem_run(manifest(directory, "straight", 2 * args.steps, warmup, args.workers, gpus))
        tandem_run(manifest(directory, "halves", args.steps, warmup, args.workers, gpus))
        resumed = tandem_run(manifest(directory, "halves", 2 * args.steps, warmup, args.workers, gpus))
        a, b = (checkpoint.load(checkpoint.latest(directory / name))["model"] for name in ("straight", "halves"))
    differing = [name for name in a if not torch.equal(a[name], b[name])]
    steps = (straight["progress"]["step"], resumed["progress"]["step"])
    print(f"resume on {args.device}, {args.workers} rank(s): {args.steps} + {args.steps} steps against "
          f"{2 * args.steps} straight (final steps {steps[0]} and {steps[1]}): "
          + ("bit-identical weights" if not differing and steps[0] == steps[1] else f"DIFFERENT: {differing}"))
    if differing or steps[0] != steps[1]:
        sys.exit(1)


if __name__ == "__main__":
    main()
