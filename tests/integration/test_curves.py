"""A short `tandem run` as a user runs it: its curves on disk as TensorBoard event files, `tandem plot` drawing them,
and the summary it ends with (the JSON status behind `-o json` is what tests/jobs.py reads)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
import yaml
from jobs import ROOT, TESTS, manifest

from tandem import cli, curves

STEPS, EVERY = 25, 10
README = (ROOT / "README.md").read_text()


def tandem_run(path, timeout: float = 300) -> subprocess.CompletedProcess:
    """As a user runs it: no `-o json` (tests/jobs.py's tandem_run passes it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "tandem.cli", "run", path.name], capture_output=True, text=True,
                          cwd=path.parent, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the directory, `tandem run`'s result): one rank, STEPS steps, a checkpoint every EVERY, beside a pool that
    serves the job."""
    directory = tmp_path_factory.mktemp("curves")
    path = manifest(directory, "curves", workers=1, trainer={"maxSteps": STEPS},
                    checkpoint={"directory": "curves/checkpoints", "everySteps": EVERY})
    (directory / "pool.yaml").write_text(yaml.safe_dump({
        "apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool", "metadata": {"name": "curves"},
        "spec": {"model": {"fromTrainingJob": {"name": "curves"}, "inputShape": [64]}}}))
    result = tandem_run(path)
    assert result.returncode == 0, result.stderr
    return directory, result


def test_rank_0_writes_the_loss_and_the_evaluation_as_tensorboard_scalars(trained):
    directory, _ = trained
    [run] = curves.run_folders(directory / "curves" / "checkpoints")
    assert run.parent == directory / "curves" / "checkpoints" / curves.DIRECTORY
    read = curves.read_scalars(run)
    assert {curves.LOSS, curves.LEARNING_RATE, curves.SAMPLES_PER_SECOND, curves.EVAL_LOSS, curves.ACCURACY} \
        <= set(read)
    assert curves.BYTES_RATIO not in read  # allReduce sends every gradient
    assert [step for step, _ in read[curves.LOSS]] == [10, 20]
    assert [step for step, _ in read[curves.ACCURACY]] == [10, 20, 25]  # each checkpoint's, the final one's too
    assert all(0 <= accuracy <= 1 for _, accuracy in read[curves.ACCURACY])


def test_the_run_ends_with_a_summary_and_the_command_that_serves_its_checkpoint(trained):
    directory, result = trained
    lines = result.stdout.splitlines()
    assert lines[0].startswith("curves: Succeeded in ") and f": step {STEPS}/{STEPS} (epoch 1), loss " in lines[0]
    assert lines[1].startswith("  eval: accuracy 0.")
    checkpoint = "curves/checkpoints/step-00000025.pt"
    assert lines[2] == f"  checkpoint: {checkpoint}"
    assert lines[3:5] == ["  curves: tandem plot curves/checkpoints",
                          "          tensorboard --logdir curves/checkpoints/tensorboard"]
    assert lines[5] == f"  serve it: tandem serve pool.yaml --checkpoint {checkpoint}"
    assert len(lines) == 6
    serve = shlex.split(lines[5].split(": ", 1)[1])
    assert (directory / serve[2]).is_file() and (directory / serve[-1]).is_file()
    shown = README.split("    $ tandem run examples/digits-train.yaml\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in shown[1:]] == [line.split()[0] for line in lines[1:]]  # as README shows


def readme_plot_command() -> list[str]:
    [line] = [line for line in README.splitlines() if line.startswith("    tandem plot ") and "-o curves.png" in line]
    return shlex.split(line.split("#")[0])[1:]


def test_tandem_plot_draws_the_curves_as_a_png(trained, monkeypatch, capsys):
    directory, _ = trained
    monkeypatch.chdir(directory)
    command = [word.replace("runs/digits-train", "curves") for word in readme_plot_command()]
    assert command == ["plot", "curves/checkpoints", "-o", "curves.png"]
    assert cli.main(command) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[-1] == "wrote curves.png"
    assert "train/loss 2 points" in printed and "eval/accuracy 3 points" in printed
    png = (directory / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


def test_tandem_plot_says_where_event_files_come_from_when_there_are_none(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    assert cli.main(["plot", "empty"]) == 1
    said = capsys.readouterr().err
    assert said.startswith("tandem plot: empty: no TensorBoard event files") and "spec.checkpoint.directory" in said
    assert not (tmp_path / "curves.png").exists()
    assert cli.main(["plot", "missing"]) == 1
    assert capsys.readouterr().err == "tandem plot: missing: no such directory\n"
