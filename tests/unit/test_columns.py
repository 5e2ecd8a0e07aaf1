"""What `kubectl get ptj` / `tip` print (tandem/columns.py), and the status texts the columns read: rank 0's loss to
four significant figures beside the exact value, samples/s, an ETA only while Running, checkpoint file names.
tests/integration/test_kubectl.py shows the real kubectl printing them."""

from __future__ import annotations

import io
import json

import pytest
from jobs import Recorder

from tandem import columns
from tandem.api import InferencePool, ParallelTrainingJobStatus
from tandem.api.training import TRAINING_PHASES
from tandem.worker.train import reporting
from tandem.worker.train.reporting import ConsoleSink, Reporter


@pytest.mark.parametrize(("loss", "printed"), [
    (0.060943720320369085, "0.06094"),  # a digits job's loss, which kubectl printed in full before
    (0.18741234567, "0.1874"),
    (2.302585092994046, "2.303"),
    (2.0, "2.000"),  # integer-like: still four significant figures
    (0.0, "0.000"),
    (1.234e-05, "1.234e-05"),
    (0.00012346, "0.0001235"),
    (1234.5, "1234"),  # no bare trailing point
    (12345.678, "1.235e+04"),
    (-0.5, "-0.5000"),
    (float("nan"), "NaN"),
    (float("inf"), "Inf"),
    (float("-inf"), "-Inf"),
    (None, None),
])
def test_loss_to_four_significant_figures(loss, printed):
    assert columns.four_figures(loss) == printed


@pytest.mark.parametrize(("rate", "printed"), [
    (1523.4, "1523"), (100.0, "100"), (99.94, "99.9"), (45.23, "45.2"), (0.4521, "0.452"), (0.0, "0"),
    (float("nan"), None), (float("inf"), None), (-1.0, None), (None, None),
])
def test_samples_per_second(rate, printed):
    assert columns.rate_text(rate) == printed


@pytest.mark.parametrize(("seconds", "printed"), [
    (-5, "<invalid>"), (-0.5, "0s"), (0, "0s"), (45, "45s"), (119, "119s"), (120, "2m"), (125, "2m5s"),
    (599, "9m59s"), (600, "10m"), (630, "10m"), (659, "10m"), (660, "11m"),  # from 10 minutes on, no seconds
    (3900, "65m"), (3 * 3600 - 1, "179m"), (3 * 3600, "3h"), (3 * 3600 + 60, "3h1m"),
    (3 * 3600 + 300, "3h5m"), (8 * 3600, "8h"), (48 * 3600, "2d"), (49 * 3600, "2d1h"), (8 * 86400, "8d"),
    (2 * 365 * 86400, "2y"), (2 * 365 * 86400 + 86400, "2y1d"), (9 * 365 * 86400, "9y"),
])
def test_durations_as_kubernetes_prints_an_age(seconds, printed):
    assert columns.human_duration(seconds) == printed


@pytest.mark.parametrize(("seconds", "printed"), [
    (45.9, "45s"), (125.0, "2m5s"), (3900.0, "65m"), (11100.0, "3h5m"), (-0.2, "0s"),  # a rate that overshot
    (float("inf"), None), (float("nan"), None), (None, None),
])
def test_eta_as_an_age(seconds, printed):
    assert columns.eta_text(seconds) == printed


@pytest.mark.parametrize(("path", "name"), [
    ("/var/lib/tandem/checkpoints/runs/digits-train/checkpoints/step-00000230.pt", "step-00000230.pt"),
    ("step-00000230.pt", "step-00000230.pt"), ("/", None), ("", None), (None, None),
])
def test_checkpoint_file_name(path, name):
    assert columns.file_name(path) == name


def running(**progress) -> ParallelTrainingJobStatus:
    return ParallelTrainingJobStatus.model_validate({"phase": "Running", "progress": progress,
                                                     "checkpoint": {"latest": "/ckpt/step-00000100.pt"}})


def test_the_status_carries_the_texts_beside_the_exact_numbers():
    wire = running(step=120, totalSteps=230, loss=0.060943720320369085, samplesPerSecond=1523.43,
                   etaSeconds=125.5).to_dict()
    assert wire["progress"] == {
        "epoch": 0, "step": 120, "totalSteps": 230, "summary": "120/230",
        "loss": 0.060943720320369085, "lossText": "0.06094",  # the value itself is not rounded
        "samplesPerSecond": 1523.43, "samplesPerSecondText": "1523", "etaSeconds": 125.5, "etaText": "2m5s"}
    assert wire["checkpoint"]["latestFile"] == "step-00000100.pt"
    assert wire["checkpoint"]["latest"] == "/ckpt/step-00000100.pt"


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), float("-inf")])
def test_a_diverged_loss_is_named_and_its_status_stays_valid_json(loss):
    status = running(step=3, totalSteps=10)
    status.progress.loss = loss  # as the Reporter sets it
    status = ParallelTrainingJobStatus.model_validate(status.model_dump())  # as it publishes
    wire = json.dumps(status.to_dict(), allow_nan=False)  # what the API server accepts (no NaN in JSON)
    progress = json.loads(wire)["progress"]
    assert progress["loss"] is None and progress["lossText"] == columns.four_figures(loss)
    again = ParallelTrainingJobStatus.model_validate_json(wire)  # read back (`tandem run`'s status file)
    assert again.progress.loss is None and again.progress.loss_text == columns.four_figures(loss)


@pytest.mark.parametrize("phase", TRAINING_PHASES)
def test_an_eta_only_while_running(phase):
    status = ParallelTrainingJobStatus.model_validate({**running(etaSeconds=60.0).model_dump(), "phase": phase})
    shown = (status.progress.eta_seconds, status.progress.eta_text)
    assert shown == ((60.0, "60s") if phase == "Running" else (None, None))


def test_the_pool_shows_the_served_checkpoints_file():
    model = InferencePool.model_validate({
        "metadata": {"name": "p"}, "spec": {"model": {"checkpoint": "/m/step-00000230.pt"}},
        "status": {"model": {"checkpoint": "/var/lib/tandem/models/step-00000230.pt"}}}).status.model
    assert (model.checkpoint_file, model.checkpoint) == ("step-00000230.pt", "/var/lib/tandem/models/step-00000230.pt")


@pytest.mark.parametrize("phase", ["Succeeded", "Suspended", "Failed"])
def test_rank_0_publishes_the_texts_while_it_trains_and_no_eta_once_it_stops(phase, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(reporting.time, "monotonic", lambda: clock[0])
    recorder, console = Recorder(), io.StringIO()
    reporter = Reporter([recorder, ConsoleSink("digits", stream=console)], workers=2, total_steps=100, interval=0.0)
    for step in range(1, 6):  # a step a second, 32 examples a step
        clock[0] = float(step)
        reporter.progress(epoch=1, step=step, loss=0.060943720320369085, samples=32 * step)
    progress = recorder.published[-1].progress
    assert (progress.loss_text, progress.samples_per_second_text, progress.eta_text) == ("0.06094", "32", "95s")
    assert console.getvalue().splitlines()[-1] == \
        "digits: Running epoch 1 step 5/100 loss 0.06094 samples/s 32 eta 95s"  # `tandem run`'s lines, off a terminal
    final = reporter.final(phase, "stopped", epoch=1, metrics={}, bytes_sent=0, dense_bytes=0).progress
    assert (final.eta_seconds, final.eta_text, final.loss) == (None, None, 0.060943720320369085)
    assert console.getvalue().splitlines()[-1].endswith("eta -")
