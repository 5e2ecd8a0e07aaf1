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


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run of each case, run once for the tests that stop and resume the same job: returns the
    directory it ran in (its job is named "straight") and its final status."""
    runs: dict[str, tuple[Path, dict]] = {}

    def run(case: str, trainer: dict, spec: dict) -> tuple[Path, dict]:
        if case not in runs:
            directory = tmp_path_factory.mktemp(f"straight-{case}")
            result = tandem_run(manifest(directory, "straight", trainer={**trainer, "maxSteps": TOTAL}, **spec))
            assert result.returncode == 0, result.stderr
            runs[case] = directory, final_status(result)
        return runs[case]

    return run


def assert_same_weights(straight_dir: Path, tmp_path: Path) -> None:
    a, b = final_weights(straight_dir, "straight"), final_weights(tmp_path, "halves")
    assert a.keys() == b.keys()
    differing = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differing, f"weights differ after resume: {differing}"


def run_in_two_halves(tmp_path: Path, trainer: dict, spec: dict) -> dict:
    result = tandem_run(manifest(tmp_path, "halves", trainer={**trainer, "maxSteps": FIRST}, **spec))
    assert result.returncode == 0, result.stderr
    assert checkpoint.load(checkpoint.latest(tmp_path / "halves" / "checkpoints"))["manifest"]["step"] == FIRST
    result = tandem_run(manifest(tmp_path, "halves", trainer={**trainer, "maxSteps": TOTAL}, **spec))
    assert result.returncode == 0, result.stderr
    return final_status(result)


@pytest.mark.parametrize("mode", MODES)
def test_a_max_steps_stop_resumes_exactly(tmp_path, straight, mode):
    straight_dir, reference = straight(mode, DROPOUT, MODES[mode])
    resumed = run_in_two_halves(tmp_path, DROPOUT, MODES[mode])
    assert resumed["progress"]["step"] == reference["progress"]["step"] == TOTAL
    assert_same_weights(straight_dir, tmp_path)


@pytest.mark.parametrize(("case", "trainer"), [
    ("accumulation", {"gradientAccumulationSteps": 2}),
    ("fp16", {"mixedPrecision": "fp16"}),
])
def test_accumulation_and_fp16_resume_exactly(tmp_path, straight, case, trainer):
    straight_dir, reference = straight(case, {**DROPOUT, **trainer}, {})
    resumed = run_in_two_halves(tmp_path, {**DROPOUT, **trainer}, {})
    assert resumed["progress"]["step"] == reference["progress"]["step"] == TOTAL, case
    assert_same_weights(straight_dir, tmp_path)


# The same job as the straight run's but for a pause in each training forward before the resume (the pause draws
# no random numbers: the weights are the same), so that the stop falls mid-run: the ranks agree on a stop within
# about 2 s of training, 62 steps take over 6 s. The resumed run does not pause.
PAUSED = {**DROPOUT, "model": "userland:dropout_mlp_paused_until_resumed",
          "modelArgs": {**DROPOUT["modelArgs"], "step_seconds": 0.1}, "maxSteps": TOTAL}


@pytest.mark.parametrize("mode", MODES)
def test_a_sigterm_stop_resumes_exactly(tmp_path, straight, mode):
    straight_dir, reference = straight(mode, DROPOUT, MODES[mode])
    stopped = run_until_signal(manifest(tmp_path, "halves", trainer=PAUSED, **MODES[mode]), signal.SIGTERM)
    assert stopped["phase"] == "Suspended"
    assert 0 < stopped["progress"]["step"] < TOTAL, "the stop must fall before the end to test a resume"
    resumed = tandem_run(manifest(tmp_path, "halves", trainer=PAUSED, **MODES[mode]))
    assert resumed.returncode == 0, resumed.stderr
    assert final_status(resumed)["progress"]["step"] == reference["progress"]["step"] == TOTAL
    assert_same_weights(straight_dir, tmp_path)
