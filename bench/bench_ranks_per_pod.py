"""One pod of N ranks against N pods of one rank, on one machine, side by side: the same job (the digits MLP made
wide, so the all-reduce carries weight), the same ranks, placed as the operator places them.

- pods of one: N `tandem worker train` processes, each seeing only its own GPU (CUDA_VISIBLE_DEVICES=i, as a
  container given one GPU) and 1/N of the cores (as each pod's CPU limit would give it): NCCL cannot join them by
  CUDA peer-to-peer and falls back to shared memory or sockets;
- one pod: `tandem worker launch` with LOCAL_WORLD_SIZE=N, every GPU visible to every rank (NVLink / P2P).

Prints rank 0's samples/s for each and their ratio. With DEVICE=cpu it runs the same on gloo (a dry run: no links
to gain). Run where several GPUs are: `python bench/bench_ranks_per_pod.py --ranks 8` (bench/device_check.sh does
when the device has more than one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.contract import WorkerContract  # noqa: E402
from tandem.worker.cores import available_cores  # noqa: E402
from tandem.worker.train.process_group import free_port  # noqa: E402


def job(directory: Path, ranks: int, gpus: int, hidden: int, steps: int) -> Path:
    document = {"apiVersion": "tandem.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": "placement"},
                "spec": {"workers": ranks, "ranksPerPod": ranks, "gpusPerWorker": gpus,
                         "trainer": {"model": "tandem.examples.digits:mlp", "modelArgs": {"hidden": hidden},
                                     "data": "tandem.examples.digits:train_data", "epochs": 1000, "maxSteps": steps,
                                     "batchSizePerWorker": 64, "requireGPU": gpus > 0},
                         "checkpoint": {"directory": str(directory / "checkpoints"), "resume": False}}}
    path = directory / "job.json"
    path.write_text(json.dumps(document))
    return path


def run(layout: str, ranks: int, spec: Path, gpus: int) -> float:
    """Rank 0's samples/s, the ranks placed as `layout` says."""
    status = spec.parent / f"status-{layout}.json"
    port = free_port()
    base = {**os.environ, "TANDEM_STATUS_FILE": str(status), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    common = {"world_size": ranks, "master_port": port, "job": "placement", "spec_path": spec}
    if layout == "one pod":
        contract = WorkerContract(rank=0, local_rank=0, local_world_size=ranks, **common)
        processes = [subprocess.Popen([sys.executable, "-m", "tandem.worker", "launch"],
                                      env={**base, **contract.pod_environ()}, stdout=subprocess.DEVNULL)]
    else:
        processes = []
        for rank in range(ranks):
            contract = WorkerContract(rank=rank, local_rank=0, local_world_size=1, **common)
            own = {"OMP_NUM_THREADS": str(max(1, available_cores() // ranks))}
            own.update({"CUDA_VISIBLE_DEVICES": str(rank)} if gpus else {})
            processes.append(subprocess.Popen([sys.executable, "-m", "tandem.worker", "train"],
                                              env={**base, **own, **contract.to_environ()}, stdout=subprocess.DEVNULL))
    codes = [process.wait(timeout=600) for process in processes]
    if any(codes):
        raise SystemExit(f"{layout}: exit codes {codes}")
    return json.loads(status.read_text())["progress"]["samplesPerSecond"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    gpus = 1 if args.device == "cuda" else 0
    with tempfile.TemporaryDirectory() as directory:
        spec = job(Path(directory), args.ranks, gpus, args.hidden, args.steps)
        rates = {layout: run(layout, args.ranks, spec, gpus) for layout in ("pods of one", "one pod")}
    print(f"{args.ranks} ranks, {args.device}, digits MLP hidden {args.hidden}, {args.steps} steps: "
          f"{args.ranks} pods of one rank {rates['pods of one']:.0f} samples/s, one pod of {args.ranks} ranks "
          f"{rates['one pod']:.0f} samples/s: ratio {rates['one pod'] / rates['pods of one']:.2f}x")


if __name__ == "__main__":
    main()
