"""Gated promotion, end to end on this machine: a real `tandem run` job whose learning rate spikes mid-run (so a
later checkpoint is worse than an earlier one) records its evaluation in each checkpoint and in
status.checkpoint.history; a server following its checkpoint directory with `fromTrainingJob.promote` never serves a
checkpoint worse than the best before it while a client sends requests, and the same server without the gate does.
The checkpoints are published into the followed directory one at a time (each atomically, as the trainer writes
them), and each is waited for until the server has judged it: no sleeps, no timing."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import tritonclient.http as triton
from jobs import final_status, manifest, tandem_run
from serving import infer, inputs, make_pool, wait_until

from tandem.worker import checkpoint

STEPS, EVERY = 80, 10
SPIKE = {"at": 50, "steps": 5, "factor": 30.0}


@pytest.fixture(scope="module")
def spiked_job(tmp_path_factory) -> tuple[list[Path], dict, dict[str, float]]:
    """The job's checkpoints (oldest first), its final status, and each checkpoint's recorded accuracy by name."""
    tmp_path = tmp_path_factory.mktemp("spike")
    path = manifest(tmp_path, "spike", workers=1, trainer={
        "model": "userland:learning_rate_spike", "modelArgs": {"hidden": 32, **SPIKE}, "maxSteps": STEPS,
        "epochs": 50, "batchSizePerWorker": 32, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
        checkpoint={"directory": str(tmp_path / "spike" / "checkpoints"), "everySteps": EVERY, "keepLast": 20})
    result = tandem_run(path)
    assert result.returncode == 0, result.stderr[-3000:]
    found = checkpoint.list_checkpoints(tmp_path / "spike" / "checkpoints")
    accuracy = {p.name: checkpoint.load(p)["manifest"]["metrics"]["accuracy"] for p in found}
    return found, final_status(result), accuracy


def test_each_checkpoint_records_its_evaluation_in_its_manifest_and_in_the_jobs_history(spiked_job):
    found, status, accuracy = spiked_job
    assert [p.name for p in found] == [f"step-{step:08d}.pt" for step in range(EVERY, STEPS + 1, EVERY)]
    history = status["checkpoint"]["history"]
    assert [Path(r["path"]).name for r in history] == [p.name for p in found]
    for record, path in zip(history, found, strict=True):
        recorded = checkpoint.load(path)["manifest"]["metrics"]
        assert set(recorded) == {"evalLoss", "accuracy"} and 0.0 <= recorded["accuracy"] <= 1.0
        assert record["metrics"] == recorded
    assert status["metrics"]["accuracy"] == accuracy[found[-1].name]  # the final checkpoint's evaluation
    before = max(accuracy[p.name] for p in found if int(p.name[5:13]) <= SPIKE["at"])
    assert accuracy[found[-1].name] < before, accuracy  # the spike made the last checkpoint worse: the test can fail


def violations(served: list[str], accuracy: dict[str, float]) -> list[str]:
    """Each served checkpoint worse than the best written up to it (names sort by step)."""
    return [name for name in dict.fromkeys(served)
            if accuracy[name] < max(value for other, value in accuracy.items() if other <= name)]


def publish(source: Path, directory: Path) -> Path:
    """Put a checkpoint into the followed directory as the trainer does: complete under a hidden name, renamed."""
    temporary = directory / f".{source.name}.tmp"
    shutil.copyfile(source, temporary)
    os.replace(temporary, directory / source.name)
    return directory / source.name


def follow_while_requests_run(served, tmp_path, found, promote: dict | None) -> tuple[list[str], int, object]:
    """Serve the job's directory with the checkpoints published one by one, under a client's requests; returns the
    checkpoint the server reported serving after each answer, the failed requests, and the server."""
    directory = tmp_path / "followed"
    directory.mkdir()
    publish(found[0], directory)
    job = {"name": "spike", **({"promote": promote} if promote else {})}
    server = served(make_pool("spike", model={"fromTrainingJob": job}), str(directory), follow_interval=0.02)
    observed: list[str] = []
    failures = []
    stop = threading.Event()

    def client() -> None:
        http = triton.InferenceServerClient(server.url)
        x = inputs(4)
        try:
            while not stop.is_set():
                try:
                    assert infer(http, x, model="spike").shape == (4, 10)
                    parameters = http.get_model_metadata("spike")["parameters"]
                    observed.append(Path(parameters["checkpoint"]).name)
                except Exception as error:  # noqa: BLE001 - counted: the test asserts there are none
                    failures.append(error)
        finally:
            http.close()

    thread = threading.Thread(target=client)
    thread.start()
    model = server.server.model
    try:
        for source in found[1:]:
            published = str(publish(source, directory))
            wait_until(lambda path=published: path in (model.loaded.checkpoint, (model.skipped or ("",))[0]),
                       what=f"{source.name} judged")
        answered = len(observed)
        wait_until(lambda: len(observed) > answered, what="an answer after the last checkpoint")
    finally:
        stop.set()
        thread.join()
    return observed, len(failures), server


def test_a_gated_pool_never_serves_a_checkpoint_worse_than_the_best_before_it(served, tmp_path, spiked_job, caplog):
    caplog.set_level(logging.INFO, logger="tandem.serve")
    found, _, accuracy = spiked_job
    observed, failed, server = follow_while_requests_run(
        served, tmp_path, found, promote={"metric": "accuracy", "mode": "max"})
    assert failed == 0
    assert violations(observed, accuracy) == []
    best = max(accuracy, key=lambda name: (accuracy[name], name))
    assert observed[-1] == best
    parameters = triton.InferenceServerClient(server.url).get_model_metadata("spike")["parameters"]
    assert parameters["metric.accuracy"] == accuracy[best]
    skipped = Path(parameters["skipped_checkpoint"]).name
    assert skipped == found[-1].name and parameters["skipped_metric"] == accuracy[skipped]
    assert parameters["skipped_reason"] == (f"accuracy {accuracy[skipped]:.6g} is not above the served "
                                            f"{accuracy[best]:.6g}")
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.serve"]
    assert any(line.startswith("not promoting spike to ") and line.endswith(parameters["skipped_reason"])
               for line in lines), lines


def test_the_same_pool_without_the_gate_serves_the_worse_checkpoint(served, tmp_path, spiked_job):
    found, _, accuracy = spiked_job
    observed, failed, _ = follow_while_requests_run(served, tmp_path, found, promote=None)
    assert failed == 0
    assert observed[-1] == found[-1].name
    assert found[-1].name in violations(observed, accuracy)


def test_a_gated_server_starts_on_the_best_checkpoint_and_a_pinned_one_on_the_named(served, tmp_path, spiked_job):
    """A restart of a gated server never brings back a refused checkpoint; `fromTrainingJob.checkpoint` serves the
    named one and keeps it."""
    found, _, accuracy = spiked_job
    directory = found[0].parent
    gated = served(make_pool("gated", model={"fromTrainingJob": {"name": "spike", "promote": {"metric": "evalLoss",
                                                                                             "mode": "min"}}}),
                   str(directory))
    losses = {p.name: checkpoint.load(p)["manifest"]["metrics"]["evalLoss"] for p in found}
    assert Path(gated.server.model.loaded.checkpoint).name == min(losses, key=losses.get)
    pinned = served(make_pool("pinned", model={"fromTrainingJob": {"name": "spike", "checkpoint": found[1].name}}),
                    str(directory))
    assert pinned.server.model.loaded.checkpoint == str(found[1])
    assert pinned.server.model.loaded.metrics["accuracy"] == accuracy[found[1].name]
    assert pinned.server.model.location.follow is False
