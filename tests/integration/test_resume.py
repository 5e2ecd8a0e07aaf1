"""Exact resume through `tandem run`, the way users resume: N steps, a stop, the same command again, must give
bit-identical weights (and the same status step) as the uninterrupted run. The model draws random numbers every
step (dropout), the stop falls mid-epoch, and every mode keeps its own state across the stop (optimizer, gradient
scaler, compression residuals and threshold, each averaging replica's own parameters)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from jobs import final_status, final_weights, manifest, run_until_signal, tandem_run

from tandem.worker import checkpoint

DROPOUT = {"model": "userland:dropout_mlp", "modelArgs": {"hidden": 32, "p": 0.3}, "evalData": None,
           "deterministic": True, "epochs": 100, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
           "lrWarmupSteps": 40}
# An epoch of the digits training set is 45 steps at 2 ranks x 16: a stop at 31 falls mid-epoch, inside the
# learning-rate warm-up, off an averaging step (frequency 3), and the resumed run crosses an epoch boundary.
FIRST, TOTAL = 31, 62
MODES = {
    "allReduce": {},
    "sharedGradients": {"trainingMode": "sharedGradients"},
    "averaging": {"trainingMode": "averaging", "averaging": {"frequency": 3}},
}


def assert_same_weights(tmp_path: Path, straight: str, resumed: str) -> None:
    a, b = final_weights(tmp_path, straight), final_weights(tmp_path, resumed)
    assert a.keys() == b.keys()
    differing = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differing, f"weights differ after resume: {differing}"


def run_in_two_halves(tmp_path: Path, name: str, trainer: dict, spec: dict) -> dict:
    result = tandem_run(manifest(tmp_path, name, trainer={**trainer, "maxSteps": FIRST}, **spec))
    assert result.returncode == 0, result.stderr
    assert checkpoint.load(checkpoint.latest(tmp_path / name / "checkpoints"))["manifest"]["step"] == FIRST
    result = tandem_run(manifest(tmp_path, name, trainer={**trainer, "maxSteps": TOTAL}, **spec))
    assert result.returncode == 0, result.stderr
    return final_status(result)


def run_straight(tmp_path: Path, name: str, trainer: dict, spec: dict) -> dict:
    result = tandem_run(manifest(tmp_path, name, trainer={"maxSteps": TOTAL, **trainer}, **spec))
    assert result.returncode == 0, result.stderr
    return final_status(result)


@pytest.mark.parametrize("mode", MODES)
def test_a_max_steps_stop_resumes_exactly(tmp_path, mode):
    straight = run_straight(tmp_path, "straight", DROPOUT, MODES[mode])
    resumed = run_in_two_halves(tmp_path, "halves", DROPOUT, MODES[mode])
    assert resumed["progress"]["step"] == straight["progress"]["step"] == TOTAL
    assert_same_weights(tmp_path, "straight", "halves")


@pytest.mark.parametrize(("case", "trainer"), [
    ("accumulation", {"gradientAccumulationSteps": 2}),
    ("fp16", {"mixedPrecision": "fp16"}),
])
def test_accumulation_and_fp16_resume_exactly(tmp_path, case, trainer):
    straight = run_straight(tmp_path, "straight", {**DROPOUT, **trainer}, {})
    resumed = run_in_two_halves(tmp_path, "halves", {**DROPOUT, **trainer}, {})
    assert resumed["progress"]["step"] == straight["progress"]["step"] == TOTAL, case
    assert_same_weights(tmp_path, "straight", "halves")


SLOW_TOTAL = 300
SLOW = {**DROPOUT, "modelArgs": {**DROPOUT["modelArgs"], "step_seconds": 0.01}, "maxSteps": SLOW_TOTAL}


@pytest.mark.parametrize("mode", MODES)
def test_a_sigterm_stop_resumes_exactly(tmp_path, mode):
    straight = run_straight(tmp_path, "straight", SLOW, MODES[mode])
    stopped = run_until_signal(manifest(tmp_path, "halves", trainer=SLOW, **MODES[mode]), signal.SIGTERM)
    assert stopped["phase"] == "Suspended"
    assert 0 < stopped["progress"]["step"] < SLOW_TOTAL, "the stop must fall before the end to test a resume"
    resumed = tandem_run(manifest(tmp_path, "halves", trainer=SLOW, **MODES[mode]))
    assert resumed.returncode == 0, resumed.stderr
    assert final_status(resumed)["progress"]["step"] == straight["progress"]["step"] == SLOW_TOTAL
    assert_same_weights(tmp_path, "straight", "halves")
