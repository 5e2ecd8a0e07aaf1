"""The trainer (issue #3) with real processes: `tandem run` launching gloo ranks on loopback, and the training
loop run directly on spawned ranks (tests/distributed.py)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from distributed import run_on_ranks

from tandem.api import ParallelTrainingJobSpec
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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "run", str(path), *args],
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


def test_two_ranks_of_batch_b_match_one_rank_of_batch_2b(tmp_path):
    plain = {"optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "maxSteps": 20}
    two = manifest(tmp_path, "two", trainer={**plain, "batchSizePerWorker": 16}, workers=2)
    one = manifest(tmp_path, "one", trainer={**plain, "batchSizePerWorker": 32}, workers=1)
    for path in (two, one):
        result = tandem_run(path)
        assert result.returncode == 0, result.stderr
    a, b = final_weights(tmp_path, "two"), final_weights(tmp_path, "one")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


EXAMPLES = ["digits-train.yaml", "digits-train-shared.yaml", "digits-train-averaging.yaml"]


@pytest.mark.parametrize("example", EXAMPLES)
def test_each_mode_reaches_090_on_digits_with_its_example(tmp_path, example):
    document = yaml.safe_load((ROOT / "examples" / example).read_text())
    document["spec"]["checkpoint"]["directory"] = str(tmp_path / "checkpoints")
    path = tmp_path / example
    path.write_text(yaml.safe_dump(document))
    result = tandem_run(path, "--status-out", str(tmp_path / "status.json"))
    assert result.returncode == 0, result.stderr
    status = final_status(result)
    assert json.loads((tmp_path / "status.json").read_text()) == status
    assert status["phase"] == "Succeeded"
    assert status["progress"]["step"] == status["progress"]["totalSteps"] > 0
    assert status["metrics"]["accuracy"] >= 0.90, status["metrics"]
    assert status["checkpoint"]["latest"] == str(checkpoint.latest(tmp_path / "checkpoints"))
    communication = status["communication"]
    assert communication["denseBytes"] > 0
    if document["spec"]["trainingMode"] == "sharedGradients":
        assert communication["bytesSent"] <= 0.05 * communication["denseBytes"], communication


def _train_recording_synchronised_replicas(rank: int, mode: str) -> list[torch.Tensor]:
    from tandem.examples.digits import eval_data, mlp, train_data
    from tandem.worker.trainer import RankContext, train

    spec = ParallelTrainingJobSpec.model_validate({
        "workers": 2, "trainingMode": mode,
        "averaging": {"frequency": 3},
        "trainer": {**DIGITS, "maxSteps": 12, "batchSizePerWorker": 16, "modelArgs": {"hidden": 16}},
        "checkpoint": {"directory": os.environ["CHECKPOINTS"]},
    })
    snapshots: list[torch.Tensor] = []

    def record(step: int, model: torch.nn.Module, synchronised: bool) -> None:
        if synchronised:
            snapshots.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())

    context = RankContext(rank=rank, world_size=2, device=torch.device("cpu"), job="replicas",
                          checkpoint_dir=Path(os.environ["CHECKPOINTS"]), listeners=[record])
    train(spec, context, mlp(hidden=16), train_data(), eval_data())
    return snapshots


@pytest.mark.parametrize("mode", ["allReduce", "sharedGradients", "averaging"])
def test_replicas_are_identical_after_every_synchronisation(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("CHECKPOINTS", str(tmp_path))
    rank0, rank1 = run_on_ranks(_train_recording_synchronised_replicas, mode, world_size=2)
    expected = 12 if mode != "averaging" else 4
    assert len(rank0) == len(rank1) == expected
    for step, (a, b) in enumerate(zip(rank0, rank1, strict=True)):
        assert torch.equal(a, b), f"{mode}: replicas differ after synchronisation {step}"
    assert not torch.equal(rank0[0], rank0[-1]), "training changed nothing"


def test_resume_is_exact(tmp_path):
    # The warm-up spans the stop: a resumed run must carry on with the schedule where it was.
    exact = {"deterministic": True, "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "lrWarmupSteps": 20}
    straight = manifest(tmp_path, "straight", trainer={**exact, "maxSteps": 30})
    assert tandem_run(straight).returncode == 0
    first_half = manifest(tmp_path, "halves", trainer={**exact, "maxSteps": 15})
    result = tandem_run(first_half)
    assert result.returncode == 0, result.stderr
    assert checkpoint.load(checkpoint.latest(tmp_path / "halves" / "checkpoints"))["manifest"]["step"] == 15
    second_half = manifest(tmp_path, "halves", trainer={**exact, "maxSteps": 30})
    result = tandem_run(second_half)
    assert result.returncode == 0, result.stderr
    assert final_status(result)["progress"]["step"] == 30
    a, b = final_weights(tmp_path, "straight"), final_weights(tmp_path, "halves")
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"


def test_sigterm_stops_every_rank_with_a_final_checkpoint(tmp_path):
    path = manifest(tmp_path, "stoppable", trainer={"epochs": 500})
    stderr = tmp_path / "stderr.txt"
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    with open(stderr, "w") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "tandem.cli", "run", str(path)],
                                    stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        deadline = time.monotonic() + 120
        while "step" not in stderr.read_text() and time.monotonic() < deadline:
            assert launcher.poll() is None, stderr.read_text()
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        stdout, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, stderr.read_text()
    status = json.loads(stdout)
    assert status["phase"] == "Suspended"
    latest = checkpoint.latest(tmp_path / "stoppable" / "checkpoints")
    assert latest is not None and status["checkpoint"]["latest"] == str(latest)
    assert 0 < status["progress"]["step"] < status["progress"]["totalSteps"]
    assert leftover_processes("stoppable") == []


def test_a_crashing_rank_fails_the_run_with_its_error_and_no_orphans(tmp_path):
    path = manifest(tmp_path, "crashing", trainer={"model": "userland:crash_on_rank_one", "modelArgs": {},
                                                   "epochs": 100})
    result = tandem_run(path, timeout=120)
    assert result.returncode == 1
    assert "rank 1 failed" in result.stderr and "injected failure in rank 1" in result.stderr
    assert final_status(result)["phase"] == "Failed"
    assert leftover_processes("crashing") == []


@pytest.mark.parametrize(("trainer", "spec", "expected"), [
    ({}, {"workers": 0}, "spec.workers: Input should be greater than or equal to 1"),
    ({"model": "tandem.examples.nope:mlp"}, {}, "cannot import module 'tandem.examples.nope'"),
    ({"model": "tandem.examples.digits:nope"}, {}, "has no attribute 'nope'"),
    ({"model": "userland:not_a_module", "modelArgs": {}}, {}, "returned a str, expected a Module"),
    ({"data": "missing.npz"}, {}, "data file 'missing.npz' does not exist"),
    ({"requireGPU": True}, {}, "requireGPU is true but CUDA is not available"),
], ids=["bad-config", "bad-module", "bad-attribute", "not-a-model", "missing-data-file", "require-gpu"])
def test_bad_config_and_references_fail_before_any_rank_starts(tmp_path, trainer, spec, expected):
    if trainer.get("requireGPU") and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = tandem_run(manifest(tmp_path, "bad", trainer=trainer, **spec))
    assert result.returncode == 2
    assert expected in result.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_a_damaged_checkpoint_is_refused_with_a_clear_error(tmp_path):
    directory = tmp_path / "damaged" / "checkpoints"
    directory.mkdir(parents=True)
    (directory / "step-00000005.pt").write_bytes(b"PK\x03\x04 definitely not a whole checkpoint")
    result = tandem_run(manifest(tmp_path, "damaged"))
    assert result.returncode == 2
    assert "truncated or corrupt" in result.stderr and "step-00000005.pt" in result.stderr


def test_nan_steps_are_skipped_then_fail_after_the_limit(tmp_path):
    some = manifest(tmp_path, "somenan", trainer={"data": "userland:nan_data", "dataArgs": {"bad_every": 16},
                                                   "evalData": None, "batchSizePerWorker": 1, "maxSteps": 40})
    result = tandem_run(some)
    assert result.returncode == 0, result.stderr
    status = final_status(result)
    assert status["metrics"]["skippedSteps"] >= 1
    assert math.isfinite(status["progress"]["loss"]), "a skipped step's NaN loss leaked into the reported loss"
    every = manifest(tmp_path, "allnan", trainer={"data": "userland:nan_data", "dataArgs": {"bad_every": 1},
                                                   "evalData": None, "maxConsecutiveBadSteps": 3})
    result = tandem_run(every)
    assert result.returncode == 1
    assert "3 consecutive steps with a NaN/Inf loss or gradient" in result.stderr


def test_averaging_reports_a_finite_loss_when_a_rank_skips_a_nan_step(tmp_path):
    """In averaging mode each rank judges its own gradients; the loss reported after an averaging is the mean over
    ranks, which must leave out a rank's skipped NaN step as the record does. Rank 1's last step is NaN here."""
    path = manifest(tmp_path, "avgnan", trainingMode="averaging", averaging={"frequency": 1},
                    trainer={"model": "userland:nan_on_rank_one", "modelArgs": {"at": 12}, "evalData": None,
                             "maxSteps": 12})
    result = tandem_run(path)
    assert result.returncode == 0, result.stderr
    status = final_status(result)
    assert math.isfinite(status["progress"]["loss"]), status["progress"]


def test_custom_mode_runs_the_users_command_with_the_contract_env(tmp_path):
    script = ("import os, pathlib; e = os.environ; pathlib.Path(e['OUT'], e['RANK'])"
              ".write_text(e['WORLD_SIZE'] + ' ' + e['TANDEM_JOB'] + ' ' + e['MASTER_PORT'])")
    path = manifest(tmp_path, "custom", trainingMode="custom",
                    custom={"command": [sys.executable, "-c", script]},
                    env=[{"name": "OUT", "value": str(tmp_path)}])
    result = tandem_run(path)
    assert result.returncode == 0, result.stderr
    assert final_status(result)["phase"] == "Succeeded"
    contents = [(tmp_path / str(rank)).read_text().split() for rank in (0, 1)]
    assert [c[:2] for c in contents] == [["2", "custom"], ["2", "custom"]]
    assert contents[0][2] == contents[1][2]


def _train_with_every_knob(rank: int, precision: str) -> float:
    from tandem.examples.digits import eval_data, mlp, train_data
    from tandem.worker.trainer import RankContext, train

    spec = ParallelTrainingJobSpec.model_validate({
        "workers": 2,
        "trainer": {**DIGITS, "maxSteps": 30, "batchSizePerWorker": 16, "gradientAccumulationSteps": 2,
                    "gradientClipNorm": 1.0, "lrWarmupSteps": 5, "lrSchedule": "cosine",
                    "mixedPrecision": precision,
                    "prefetchBuffer": 2, "optimizer": {"name": "adamw", "lr": 0.01, "weightDecay": 0.01}},
        "checkpoint": {"directory": os.environ["CHECKPOINTS"]},
    })
    context = RankContext(rank=rank, world_size=2, device=torch.device("cpu"), job="knobs",
                          checkpoint_dir=Path(os.environ["CHECKPOINTS"]))
    status = train(spec, context, mlp(hidden=32), train_data(), eval_data())
    return status.metrics["accuracy"] if status else -1.0


@pytest.mark.parametrize("precision", ["none", "bf16", "fp16"])
def test_accumulation_clipping_warmup_and_mixed_precision_train(tmp_path, monkeypatch, precision):
    monkeypatch.setenv("CHECKPOINTS", str(tmp_path))
    accuracy, _ = run_on_ranks(_train_with_every_knob, precision, world_size=2)
    assert accuracy >= 0.3, f"{precision}: accuracy {accuracy} after 30 steps (chance is 0.1)"


def test_parallel_wrapper_trains_the_callers_model(tmp_path):
    from tandem import ParallelWrapper
    from tandem.examples.digits import eval_data, mlp, train_data

    torch.manual_seed(0)
    model = mlp(hidden=32)
    before = [p.detach().clone() for p in model.parameters()]
    with ParallelWrapper(model, workers=2, mode="allReduce", batch_size=16, epochs=5, lr=0.05,
                         show_progress=False) as wrapper:
        status = wrapper.fit(train_data(), eval_data=eval_data())
    assert status.phase == "Succeeded"
    assert status.metrics["accuracy"] >= 0.9
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(RuntimeError, match="closed"):
        wrapper.fit(train_data())


def test_parallel_wrapper_ranks_update_their_own_replicas():
    """2 workers x batch 16 give the weights of 1 worker x batch 32, as with `tandem run`: ranks that shared the
    caller's parameters in memory would each apply the update to the same tensors."""
    from tandem import ParallelWrapper
    from tandem.examples.digits import mlp, train_data

    trained = []
    for workers, batch_size in ((2, 16), (1, 32)):
        torch.manual_seed(0)
        model = mlp(hidden=32)
        with ParallelWrapper(model, workers=workers, batch_size=batch_size, max_steps=20, lr=0.1,
                             show_progress=False) as wrapper:
            wrapper.fit(train_data())
        trained.append(model.state_dict())
    for name in trained[0]:
        torch.testing.assert_close(trained[0][name], trained[1][name], rtol=1e-4, atol=1e-5)


def test_the_readme_parallel_wrapper_example_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    example = next(block.split("```", 1)[0] for block in readme.split("```python\n")[1:] if "ParallelWrapper(" in block)
    script = tmp_path / "readme_example.py"
    script.write_text(example)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.strip().splitlines()[-1]) >= 0.9
