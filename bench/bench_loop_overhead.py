"""The training loop's own cost per step, this checkout against another revision: did a change to the loop cost speed?

    .venv/bin/python bench/bench_loop_overhead.py --against b7dd2bd      # about a minute on 2 cores

Each side runs Tandem's `train()` in a fresh process on one rank (gloo, world size 1, one torch thread) with a
model so small (the digits MLP with 8 hidden units, batch 4) that the loop's Python work is a large part of a
step, and times steps 500 to 5000 (start-up and the first steps excluded) in process CPU time and wall time. The
sides alternate, `--rounds` times each, and the ratio of the medians is printed. The other revision is checked
out in a temporary git worktree.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MEASURE = r"""
import os, sys, tempfile, time
from pathlib import Path
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
from tandem.api import ParallelTrainingJobSpec
from tandem.examples.digits import mlp, train_data
if Path(sys.argv[2], "worker", "train", "trainer.py").is_file():
    from tandem.worker.train.trainer import RankContext, train
else:
    from tandem.worker.trainer import RankContext, train
data = train_data()

def run(steps):
    directory = tempfile.mkdtemp()
    spec = ParallelTrainingJobSpec.model_validate({"workers": 1, "checkpoint": {"directory": directory}, "trainer": {
        "model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data", "maxSteps": steps,
        "epochs": 1000, "batchSizePerWorker": 4}})
    context = RankContext(rank=0, world_size=1, device=torch.device("cpu"), job="overhead",
                          checkpoint_dir=Path(directory))
    torch.manual_seed(0)
    cpu, wall = time.process_time(), time.perf_counter()
    train(spec, context, mlp(hidden=8), data)
    return time.process_time() - cpu, time.perf_counter() - wall

run(200)
short, long = run(500), run(5000)
print((long[0] - short[0]) / 4500 * 1e6, (long[1] - short[1]) / 4500 * 1e6)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(tree: Path) -> tuple[float, float]:
    """(CPU us, wall us) per step of the loop in `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("OMP_NUM_THREADS", None)
    result = subprocess.run([sys.executable, "-c", MEASURE, str(free_port()), str(tree)], cwd=tree, env=env,
                            capture_output=True, text=True, check=True)
    cpu, wall = map(float, result.stdout.split()[-2:])
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="the git revision to compare with (e.g. a commit)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        other = Path(scratch) / "other"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(other), args.against], cwd=ROOT, check=True)
        try:
            results: dict[str, list[tuple[float, float]]] = {"this checkout": [], args.against: []}
            for _ in range(args.rounds):
                for name, tree in (("this checkout", ROOT), (args.against, other)):
                    results[name].append(measure(tree))
                    cpu, wall = results[name][-1]
                    print(f"{name}: {cpu:.1f} us CPU, {wall:.1f} us wall per step", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=True)
    medians = {name: statistics.median(cpu for cpu, _ in runs) for name, runs in results.items()}
    print(f"median CPU per step: this checkout {medians['this checkout']:.1f} us, {args.against} "
          f"{medians[args.against]:.1f} us; ratio {medians['this checkout'] / medians[args.against]:.3f}")


if __name__ == "__main__":
    main()
