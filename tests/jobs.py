"""Training jobs for tests, run as a user runs them: a manifest on disk, `tandem run` in a subprocess, the final
status it prints, the checkpoints it leaves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from tandem.api import ParallelTrainingJobStatus
from tandem.worker import checkpoint

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
DIGITS = {
    "model": "tandem.examples.digits:mlp",
    "data": "tandem.examples.digits:train_data",
    "evalData": "tandem.examples.digits:eval_data",
}


def manifest(tmp_path: Path, name: str, *, trainer: dict | None = None, **spec) -> Path:
    document = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "ParallelTrainingJob",
        "metadata": {"name": name},
        "spec": {
            "workers": 2,
            "trainer": {**DIGITS, "modelArgs": {"hidden": 32}, "batchSizePerWorker": 16, **(trainer or {})},
            "checkpoint": {"directory": str(tmp_path / name / "checkpoints")},
            **spec,
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def tandem_run(path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`tandem run` to its end, its final status as JSON on stdout (`-o json`: `final_status` reads it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "run", str(path), "-o", "json", *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=path.parent,
    )


def final_status(result: subprocess.CompletedProcess) -> dict:
    return json.loads(result.stdout)


def final_weights(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    latest = checkpoint.latest(tmp_path / name / "checkpoints")
    assert latest is not None, f"no checkpoint for {name}"
    return checkpoint.load(latest)["model"]


def leftover_processes(job_name: str) -> list[int]:
    """PIDs of processes started for `job_name` (found by the TANDEM_JOB in their environment)."""
    marker = f"TANDEM_JOB={job_name}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def start_tandem_run(path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """`tandem run` started in the background (its final status as JSON on stdout); with the file its stderr goes
    to."""
    stderr = path.parent / f"{path.stem}-stderr.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    with open(stderr, "w") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "tandem.cli", "run", str(path), "-o", "json", *args],
                                    cwd=path.parent,
                                    stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    return launcher, stderr


def wait_for_stderr(launcher: subprocess.Popen, stderr: Path, done, timeout: float = 120) -> None:
    """Until `done(text of stderr)` holds; fails if the launcher exits first."""
    deadline = time.monotonic() + timeout
    while not done(stderr.read_text()):
        assert launcher.poll() is None, stderr.read_text()
        assert time.monotonic() < deadline, stderr.read_text()
        time.sleep(0.1)


def start_training(path: Path) -> tuple[subprocess.Popen, Path]:
    """`tandem run` started, returned once rank 0 has reported progress; with the file its stderr goes to."""
    launcher, stderr = start_tandem_run(path)
    wait_for_stderr(launcher, stderr, lambda text: max(map(int, re.findall(r"step (\d+)/", text)), default=0) >= 1)
    return launcher, stderr


def run_until_signal(path: Path, signum: int) -> dict:
    """`tandem run` stopped by `signum` once training has made progress; returns the final status."""
    launcher, stderr = start_training(path)
    launcher.send_signal(signum)
    stdout, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, stderr.read_text()
    return json.loads(stdout)


class Recorder:
    """A status sink for a Reporter that keeps a copy of every status published."""

    def __init__(self) -> None:
        self.published: list[ParallelTrainingJobStatus] = []

    def publish(self, status: ParallelTrainingJobStatus) -> None:
        self.published.append(status.model_copy(deep=True))

    def close(self) -> None:
        pass
