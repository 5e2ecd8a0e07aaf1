"""Elastic training under `tandem run` (spec.elastic, recovery regroup) with real rank processes: a rank killed or
stopped costs the step in flight, not a restart. The survivor keeps its process and goes on alone, the launcher's
replacement joins and takes the state from it, and across every size change each example of an epoch is trained
on once (each rank logs what it took: TANDEM_EXAMPLES_LOG). Rank 0 is replaced like the others: the coordinator (the
job's store and planner) is a process of its own; its loss, and a regroup past its deadline, fall back to a
whole-group restart from the latest checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from jobs import final_status, leftover_processes, manifest, start_tandem_run, tandem_run, wait_for_stderr

from tandem import curves
from tandem.worker import checkpoint

EPOCHS = 12
"""Long enough for the interrupted run's accuracy to settle within the noise of runs: sharedGradients', the
noisiest, spans 0.961-0.975 over four seeds uninterrupted, and 0.947-0.978 over six interrupted runs (at 6 epochs
0.944-0.955 and 0.891-0.947: a bound of 0.03 failed about one run in six)."""
EPOCH_SIZE = 1438  # tandem.examples.digits:train_data
STEP_EXAMPLES = 32  # workers 2 x batchSizePerWorker 16: the global batch, kept at every size


def rank_pid(launcher: subprocess.Popen, rank: int | str) -> int | None:
    """The pid of the rank process `rank` that `launcher` (`tandem run`) started, if one runs; "coordinator": the
    elastic job's coordinator's."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                environ = (entry / "environ").read_bytes().split(b"\0")
                command = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if parent != launcher.pid:
                continue
            if rank == "coordinator" and b"coordinator" in command or f"RANK={rank}".encode() in environ:
                return int(entry.name)
    return None


@pytest.fixture
def launched():
    """The `tandem run` launchers a test starts, stopped (with their ranks) if the test fails midway."""
    started: list[subprocess.Popen] = []
    yield started
    for launcher in started:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            try:
                launcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                launcher.kill()


def examples_by_epoch(log: Path) -> list[Counter]:
    """The example indices trained on in each epoch, over every rank (a line per rank and completed step)."""
    steps_per_epoch = -(-EPOCH_SIZE // STEP_EXAMPLES)
    epochs = [Counter() for _ in range(EPOCHS)]
    for line in log.read_text().splitlines():
        _, step, *indices = map(int, line.split())
        epochs[(step - 1) // steps_per_epoch].update(indices)
    return epochs


def elastic_job(tmp_path: Path, name: str, *, go: Path, mode: str = "allReduce", **elastic) -> Path:
    return manifest(tmp_path, name, trainingMode=mode, elastic={"minWorkers": 1, **elastic},
                    trainer={"model": "userland:paced_until",
                             "modelArgs": {"until": str(go), "hidden": 64, "step_seconds": 0.1},
                             "epochs": EPOCHS, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
                    checkpoint={"directory": str(tmp_path / name / "checkpoints"), "everySteps": 40})


def step_of(text: str) -> int:
    steps = [int(part.split("/")[0]) for part in text.split("step ")[1:] if part.split("/")[0].isdigit()]
    return max(steps, default=0)


def kill_until_replaced(launcher: subprocess.Popen, stderr: Path, lost: int) -> float:
    """SIGKILL rank `lost` (of two): the survivor regroups alone, keeping its process, and the launcher's
    replacement joins; the seconds from the kill to the regroup."""
    survivor = rank_pid(launcher, 1 - lost)
    killed_at = time.monotonic()
    os.kill(rank_pid(launcher, lost), signal.SIGKILL)
    wait_for_stderr(launcher, stderr, lambda text: f"regrouped: generation 2, 1 rank(s) (lost rank(s) {lost})" in text)
    regrouped_in = time.monotonic() - killed_at
    wait_for_stderr(launcher, stderr, timeout=180,
                    done=lambda text: f"regrouped: generation 3, 2 rank(s) (added rank(s) {lost})" in text)
    assert rank_pid(launcher, 1 - lost) == survivor, "the survivor kept its process"
    return regrouped_in


@pytest.mark.parametrize("mode", ["allReduce", "sharedGradients", "averaging"])
def test_a_rank_killed_mid_epoch_is_replaced_without_a_restart(tmp_path, monkeypatch, launched, mode):
    """SIGKILL of rank 1 mid-epoch: rank 0 (same pid) regroups alone within seconds, the replacement joins and takes
    the state from it, `restarts` stays 0, every example of every epoch is trained on once (averaging: but for the
    lost rank's share of the steps since the last averaging, which its replica took with it), and the accuracy is an
    uninterrupted run's within noise."""
    go, log = tmp_path / "go", tmp_path / "examples.log"
    monkeypatch.setenv("TANDEM_EXAMPLES_LOG", str(log))
    path = elastic_job(tmp_path, "killed", go=go, mode=mode)
    launcher, stderr = start_tandem_run(path)
    launched.append(launcher)
    wait_for_stderr(launcher, stderr, lambda text: step_of(text) >= 10)
    regrouped_in = kill_until_replaced(launcher, stderr, 1)
    go.touch()
    stdout, _ = launcher.communicate(timeout=180)
    text = stderr.read_text()
    assert launcher.returncode == 0, text
    status = json.loads(stdout)
    assert (status["phase"], status["restarts"]) == ("Succeeded", 0), text
    assert status["recoveries"] == {"regroups": 2, "restarts": 0}
    last = status["lastRecovery"]
    assert (last["kind"], last["added"], last["workers"]) == ("regroup", [1], 2)
    assert last["resumedAtStep"] == last["stoppedAtStep"], "a join loses no step"
    assert regrouped_in < 30, "noticed and regrouped in seconds (the figures: bench/bench_regroup.py)"
    assert "rank 1 exited with code -9 (killed by SIGKILL): started a replacement" in text
    epochs = examples_by_epoch(log)
    assert all(max(epoch.values()) == 1 for epoch in epochs), "no example twice in an epoch"
    missing = sum(EPOCH_SIZE - len(epoch) for epoch in epochs)
    if mode != "averaging":
        assert missing == 0, "each example of each epoch once"
    else:  # what the lost rank trained since the last averaging (every step here) went with its replica
        assert missing <= STEP_EXAMPLES // 2, missing
    assert leftover_processes("killed") == []

    go_straight = tmp_path / "go-straight"
    go_straight.touch()
    monkeypatch.delenv("TANDEM_EXAMPLES_LOG")
    straight = tandem_run(elastic_job(tmp_path, "straight", go=go_straight, mode=mode))
    assert straight.returncode == 0, straight.stderr
    accuracy, uninterrupted = status["metrics"]["accuracy"], final_status(straight)["metrics"]["accuracy"]
    assert abs(accuracy - uninterrupted) <= 0.03, (accuracy, uninterrupted)


def test_rank_0_killed_is_replaced_alone_and_its_duties_follow_rank_0(tmp_path, monkeypatch, launched):
    """SIGKILL of rank 0 mid-epoch (slot 0: the status, the checkpoints, the curves): rank 1 (same pid) becomes rank
    0 of the next generation at once and takes them on, training on alone; slot 0's replacement joins and is rank 0
    again. `restarts` stays 0, every example of every epoch is trained on once, the checkpoints go on in the run's
    record, the status keeps its history, and the curves go on in the same run folder (a new event file)."""
    go, log = tmp_path / "go", tmp_path / "examples.log"
    monkeypatch.setenv("TANDEM_EXAMPLES_LOG", str(log))
    path = elastic_job(tmp_path, "first", go=go)
    launcher, stderr = start_tandem_run(path)
    launched.append(launcher)
    wait_for_stderr(launcher, stderr, lambda text: step_of(text) >= 45)  # past the checkpoint of step 40
    kill_until_replaced(launcher, stderr, 0)
    go.touch()
    stdout, _ = launcher.communicate(timeout=180)
    text = stderr.read_text()
    assert launcher.returncode == 0, text
    assert "rank 0 exited with code -9 (killed by SIGKILL): started a replacement" in text
    status = json.loads(stdout)
    assert (status["phase"], status["restarts"]) == ("Succeeded", 0), text
    assert status["recoveries"] == {"regroups": 2, "restarts": 0}
    last = status["lastRecovery"]
    assert (last["kind"], last["added"], last["workers"]) == ("regroup", [0], 2), last
    assert status["progress"]["step"] == status["progress"]["totalSteps"]
    history = [record["step"] for record in status["checkpoint"]["history"]]
    expected = [*range(40, status["progress"]["step"], 40), status["progress"]["step"]]
    assert history == expected[-len(history):], history  # one record each, none lost across the takeovers
    epochs = examples_by_epoch(log)
    assert all(max(epoch.values()) == 1 for epoch in epochs), "no example twice in an epoch"
    assert sum(EPOCH_SIZE - len(epoch) for epoch in epochs) == 0, "each example of each epoch once"
    directory = tmp_path / "first" / "checkpoints"
    assert checkpoint.latest(directory).name == f"step-{status['progress']['step']:08d}.pt"
    [run] = curves.run_folders(directory)
    assert len(list(run.glob("events.out.tfevents.*"))) == 3, "slot 0, then slot 1, then slot 0's replacement"
    steps = [step for step, _ in curves.read_scalars(run)[curves.LOSS]]
    assert steps == sorted(set(steps)) and steps[-1] >= status["progress"]["step"] - 10, steps
    assert leftover_processes("first") == []


def test_a_stopped_rank_is_left_behind_within_seconds_and_rejoins_when_it_wakes(tmp_path, launched):
    """SIGSTOP of rank 1: its connections stay open, so no collective fails; its heartbeat stalls and rank 0
    abandons the step in flight and goes on alone. Woken (SIGCONT), the same process finds its group gone and joins
    again, taking the state from rank 0; nothing restarts.

    With batch perRank (lrScaling linear) the group of one trains at half the learning rate (its global batch halved
    too), said in rank 0's log, and at the full rate again once the rank rejoins: rank 0's TensorBoard curve
    train/lr shows all three phases. The checkpoint written meanwhile (step 40) records the group of one."""
    go = tmp_path / "go"
    path = elastic_job(tmp_path, "stopped", go=go, batch="perRank")
    launcher, stderr = start_tandem_run(path)
    launched.append(launcher)
    wait_for_stderr(launcher, stderr, lambda text: step_of(text) >= 10)
    sleeper = rank_pid(launcher, 1)
    os.kill(sleeper, signal.SIGSTOP)
    try:
        wait_for_stderr(launcher, stderr,
                        lambda text: "heartbeat stalled" in text and "regrouped: generation 2" in text)
        alone_from = step_of(stderr.read_text())
        wait_for_stderr(launcher, stderr, lambda text: step_of(text) >= max(alone_from + 25, 45))
        written = checkpoint.load(checkpoint.checkpoint_path(tmp_path / "stopped" / "checkpoints", 40))
    finally:
        os.kill(sleeper, signal.SIGCONT)
    wait_for_stderr(launcher, stderr, lambda text: "regrouped: generation 3, 2 rank(s) (added rank(s) 1)" in text,
                    timeout=180)
    assert rank_pid(launcher, 1) == sleeper, "the woken process itself rejoined"
    go.touch()
    stdout, _ = launcher.communicate(timeout=180)
    text = stderr.read_text()
    assert launcher.returncode == 0, text
    status = json.loads(stdout)
    assert (status["phase"], status["restarts"], status["recoveries"]["regroups"]) == ("Succeeded", 0, 2)
    assert "code 75: started a replacement" not in text, "a rank that says the group must restart is not replaced"
    assert "batch perRank: global batch 16, learning rate x0.5 (lrScaling linear, 1 of 2 workers)" in text
    assert "batch perRank: global batch 32, learning rate x1 (lrScaling linear, 2 of 2 workers)" in text
    [run] = curves.run_folders(tmp_path / "stopped" / "checkpoints")
    rates = [rate for _, rate in curves.read_scalars(run)[curves.LEARNING_RATE]]
    assert rates[0] == rates[-1] == pytest.approx(0.05), rates
    assert pytest.approx(0.025) in rates, rates
    assert (written["manifest"]["world_size"], len(written["per_rank"])) == (1, 1)


def start_frozen_in_evaluation(tmp_path: Path, name: str, launched: list, *, go: Path, step_seconds: float,
                               epochs: int, every_steps: int) -> tuple[subprocess.Popen, Path, int]:
    """`tandem run` of an elastic job whose rank 1 stops itself in its first evaluation (userland's
    freezes_in_evaluation), returned once it has: the launcher, its stderr file, and the stopped rank's pid."""
    stopped = tmp_path / "stopped"
    path = manifest(tmp_path, name, elastic={"minWorkers": 1},
                    trainer={"model": "userland:freezes_in_evaluation",
                             "modelArgs": {"until": str(go), "stopped": str(stopped), "step_seconds": step_seconds},
                             "epochs": epochs, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
                    checkpoint={"directory": str(tmp_path / name / "checkpoints"), "everySteps": every_steps})
    launcher, stderr = start_tandem_run(path)
    launched.append(launcher)
    wait_for_stderr(launcher, stderr, lambda text: stopped.exists())
    return launcher, stderr, rank_pid(launcher, 1)


def test_a_rank_frozen_in_the_final_checkpoint_leaves_the_others_to_write_it(tmp_path, launched):
    """Rank 1 stops (SIGSTOP) inside the evaluation of the final checkpoint (the job's only one): rank 0 regroups
    alone and writes it itself; the job Succeeds without a restart. Woken, rank 1 finds the training over."""
    launcher, stderr, sleeper = start_frozen_in_evaluation(tmp_path, "final", launched, go=tmp_path / "go",
                                                           step_seconds=0.0, epochs=2, every_steps=1000)
    try:
        wait_for_stderr(launcher, stderr, timeout=60, done=lambda text: "Succeeded" in text)
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone if the group was restarted
            os.kill(sleeper, signal.SIGCONT)
    stdout, _ = launcher.communicate(timeout=120)
    text = stderr.read_text()
    assert launcher.returncode == 0, text
    assert "heartbeat stalled" in text and "regrouped: generation 2, 1 rank(s) (lost rank(s) 1)" in text
    status = json.loads(stdout)
    assert (status["phase"], status["restarts"]) == ("Succeeded", 0), status
    assert status["progress"]["step"] == status["progress"]["totalSteps"] == 90
    assert status["checkpoint"]["latest"].endswith("step-00000090.pt") and "accuracy" in status["metrics"]


def test_a_rank_frozen_in_a_checkpoints_evaluation_is_left_behind_within_seconds(tmp_path, launched):
    """Rank 1 stops (SIGSTOP) inside the evaluation of the checkpoint of step 40: rank 0, waiting for its totals,
    abandons the checkpoint once rank 1's heartbeat stalls (not at the group's timeout, 300 s) and goes on alone;
    woken, rank 1 rejoins. A checkpoint's collectives (the evaluation's totals, each rank's state gathered to rank
    0) are waited on as a step's are."""
    go = tmp_path / "go"
    launcher, stderr, sleeper = start_frozen_in_evaluation(tmp_path, "frozen", launched, go=go, step_seconds=0.1,
                                                           epochs=4, every_steps=40)
    try:
        wait_for_stderr(launcher, stderr, timeout=60,
                        done=lambda text: "heartbeat stalled" in text and "regrouped: generation 2" in text)
    finally:
        os.kill(sleeper, signal.SIGCONT)
    wait_for_stderr(launcher, stderr, lambda text: "regrouped: generation 3, 2 rank(s) (added rank(s) 1)" in text,
                    timeout=180)
    go.touch()
    stdout, _ = launcher.communicate(timeout=180)
    assert launcher.returncode == 0, stderr.read_text()
    status = json.loads(stdout)
    assert (status["phase"], status["restarts"], status["recoveries"]["regroups"]) == ("Succeeded", 0, 2)
    assert "lost a member at step 40" in stderr.read_text()


@pytest.mark.parametrize(("lost", "elastic", "why"), [
    ("coordinator", {}, "RegroupFailed: the job's coordinator (its store) is gone"),
    (1, {"minWorkers": 2, "regroupDeadlineSeconds": 1},
     "RegroupFailed: 1 rank(s) left, fewer than elastic.minWorkers (2) within elastic.regroupDeadlineSeconds (1s)"),
], ids=["coordinator lost", "regroup past its deadline"])
def test_a_loss_the_group_cannot_regroup_from_falls_back_to_a_restart_from_the_checkpoint(tmp_path, launched, lost,
                                                                                         elastic, why):
    """The coordinator lost (the job's store and planner), or rank 1 lost (frozen: its heartbeat stalls) with
    minWorkers 2 of 2 and no rank to join within a deadline of 1 s: the job restarts whole from its latest
    checkpoint, says why, and counts it (restarts, recoveries.restarts, lastRecovery a restart); the ranks that say
    so (exit code 75) are not replaced alone."""
    go = tmp_path / "go"
    path = elastic_job(tmp_path, "fallback", go=go, **elastic)
    launcher, stderr = start_tandem_run(path, "--restart-backoff-seconds", "0")
    launched.append(launcher)
    wait_for_stderr(launcher, stderr, lambda text: step_of(text) >= 45)  # past the checkpoint of step 40
    # rank 1 frozen, not killed: nothing replaces a process that has not exited, so no rank can join within the
    # deadline however quickly a replacement would start (a killed one's, on a quiet machine, once joined in time)
    os.kill(rank_pid(launcher, lost), signal.SIGKILL if lost == "coordinator" else signal.SIGSTOP)
    wait_for_stderr(launcher, stderr, lambda text: "restart 1 of 3" in text)
    go.touch()
    stdout, _ = launcher.communicate(timeout=180)
    text = stderr.read_text()
    assert launcher.returncode == 0, text
    assert why in text
    assert "code 75: started a replacement" not in text, "a rank that says the group must restart is not replaced"
    status = json.loads(stdout)
    assert (status["phase"], status["restarts"], status["recoveries"]["restarts"]) == ("Succeeded", 1, 1), status
    last = status["lastRecovery"]
    assert (last["kind"], last["workers"], last["resumedAtStep"]) == ("restart", 2, 40), last
    assert last["stoppedAtStep"] >= 45 and last["seconds"] >= 0, last
