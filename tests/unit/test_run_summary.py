"""What `tandem run` prints at its end (tandem/backends/run_summary.py): a few lines for a person, with the command
that serves the checkpoint, or the status as JSON with `-o json`."""

from __future__ import annotations

import json
import shlex
from datetime import UTC, datetime, timedelta

import yaml

from tandem.api import ParallelTrainingJob, ParallelTrainingJobStatus
from tandem.backends.run_summary import Ending, summary_lines
from tandem.curves import DIRECTORY

START = datetime(2026, 1, 1, tzinfo=UTC)


def job(tmp_path, name: str = "digits-train") -> ParallelTrainingJob:
    return ParallelTrainingJob.model_validate({
        "metadata": {"name": name},
        "spec": {"workers": 2, "trainer": {"model": "m:f", "data": "m:d"},
                 "checkpoint": {"directory": str(tmp_path / "checkpoints")}}})


def finished(tmp_path, phase: str = "Succeeded", **metrics: float) -> ParallelTrainingJobStatus:
    status = ParallelTrainingJobStatus(phase=phase, start_time=START, completion_time=START + timedelta(seconds=16))
    status.progress.step = status.progress.total_steps = 230
    status.progress.epoch, status.progress.loss = 10, 0.0609412
    status.metrics = metrics
    status.checkpoint.latest = str(tmp_path / "checkpoints" / "step-00000230.pt")
    return ParallelTrainingJobStatus.model_validate(status.model_dump())


def pool(path, job_name: str) -> None:
    path.write_text(yaml.safe_dump({"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool",
                                    "metadata": {"name": "digits"},
                                    "spec": {"model": {"fromTrainingJob": {"name": job_name}}}}))


def test_a_finished_run_says_how_far_its_evaluation_its_checkpoint_its_curves_and_how_to_serve_it(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints" / DIRECTORY).mkdir(parents=True)
    (tmp_path / "other.yaml").write_text("kind: [not, a, manifest")  # not ours to judge: passed over
    pool(tmp_path / "digits-pool.yaml", "digits-train")
    lines = summary_lines(job(tmp_path), finished(tmp_path, evalLoss=0.11057, accuracy=0.969359),
                          tmp_path / "digits-train.yaml")
    assert lines == [
        "digits-train: Succeeded in 16s: step 230/230 (epoch 10), loss 0.06094",
        "  eval: accuracy 0.9694, loss 0.1106",
        "  checkpoint: checkpoints/step-00000230.pt",
        "  curves: tandem plot checkpoints",
        "          tensorboard --logdir checkpoints/tensorboard",
        "  serve it: tandem serve digits-pool.yaml --checkpoint checkpoints/step-00000230.pt",
    ]
    command = shlex.split(lines[-1].split(": ", 1)[1])
    assert command[:2] == ["tandem", "serve"] and (tmp_path / command[2]).is_file()


def test_without_a_pool_for_the_job_the_serve_command_names_one_to_write(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pool(tmp_path / "other-pool.yaml", "another-job")
    lines = summary_lines(job(tmp_path), finished(tmp_path), tmp_path / "digits-train.yaml")
    assert lines[-2:] == [
        "  serve it: tandem serve POOL.yaml --checkpoint checkpoints/step-00000230.pt",
        "    (POOL.yaml: an InferencePool manifest for this model, as examples/digits-pool.yaml)",
    ]
    assert not any("curves" in line for line in lines)  # no event files were written


def test_a_stopped_run_says_the_same_command_resumes_and_names_no_serve_command(tmp_path):
    status = finished(tmp_path, "Suspended", skippedSteps=3)
    status.restarts = 1
    lines = summary_lines(job(tmp_path), status, tmp_path / "job.yaml")
    assert lines[0] == "digits-train: Suspended in 16s: step 230/230 (epoch 10), loss 0.06094, 3 steps skipped " \
                       "(NaN/Inf), 1 restart"
    assert lines[-1] == "  run the same command again to resume from it"
    assert not any("serve" in line or "eval" in line for line in lines)


def test_json_output_prints_the_status_and_status_out_writes_it_either_way(tmp_path, capsys):
    status = finished(tmp_path, accuracy=0.97)
    Ending(tmp_path / "job.yaml", "json", str(tmp_path / "status.json")).show(job(tmp_path), status)
    printed = capsys.readouterr().out
    assert json.loads(printed) == status.to_dict() == json.loads((tmp_path / "status.json").read_text())

    Ending(tmp_path / "job.yaml", "summary", str(tmp_path / "again.json")).show(job(tmp_path), status)
    assert capsys.readouterr().out.startswith("digits-train: Succeeded")
    assert json.loads((tmp_path / "again.json").read_text()) == status.to_dict()


def test_a_job_that_reported_no_step_says_its_message(tmp_path):
    status = ParallelTrainingJobStatus(phase="Succeeded", message="all ranks exited 0", start_time=START,
                                       completion_time=START + timedelta(seconds=3))
    assert summary_lines(job(tmp_path), status, tmp_path / "job.yaml") == [
        "digits-train: Succeeded in 3s: all ranks exited 0"]
