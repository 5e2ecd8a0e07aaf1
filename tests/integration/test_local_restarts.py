"""`tandem run` applies the operator's restart policy (tandem/restart_policy.py) with real ranks: a failed rank
restarts the whole group from the latest checkpoint, backoffLimit fails the job, activeDeadlineSeconds holds, a stop
during a backoff is obeyed at once; and a checkpoint written at another world size resumes (`--workers`)."""

from __future__ import annotations

import json
import signal
import time

import pytest
from jobs import (
    final_status,
    final_weights,
    leftover_processes,
    manifest,
    start_tandem_run,
    tandem_run,
    wait_for_stderr,
)
from serving import wait_until

from tandem.worker import checkpoint
from tandem.worker.train.reporting import read_status_file

NO_BACKOFF = ("--restart-backoff-seconds", "0")
DROPOUT = {"modelArgs": {"hidden": 32, "p": 0.3}, "evalData": None, "deterministic": True,
           "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}}


def test_a_rank_that_crashes_once_restarts_the_group_from_the_checkpoint_and_ends_as_if_it_never_crashed(tmp_path):
    """Rank 1 crashes in step 11, right after the checkpoint of step 10 is complete: the group restarts from it and
    ends with the weights of a run that never crashed (the checkpoint holds every generator, so the model's dropout
    continues exactly)."""
    every = {"everySteps": 10}
    trainer = {**DROPOUT, "model": "userland:crash_once_after_checkpoint", "maxSteps": 20}
    crashing = manifest(tmp_path, "crashes", trainer={**trainer, "modelArgs": {**DROPOUT["modelArgs"], "at": 11}},
                        checkpoint={"directory": str(tmp_path / "crashes" / "checkpoints"), **every})
    result = tandem_run(crashing, *NO_BACKOFF)
    assert result.returncode == 0, result.stderr
    status = final_status(result)
    assert (status["phase"], status["restarts"]) == ("Succeeded", 1)
    assert status["progress"]["step"] == status["progress"]["totalSteps"] == 20
    assert status["checkpoint"]["history"][0]["path"].endswith("step-00000010.pt"), "resumed from step 10"
    assert "injected failure in rank 1 after step-00000010.pt" in result.stderr
    assert "rank 1 exited with code 1; restart 1 of 3 from the latest checkpoint in 0 s" in result.stderr
    assert leftover_processes("crashes") == []

    straight = manifest(tmp_path, "straight", trainer=trainer,
                        checkpoint={"directory": str(tmp_path / "straight" / "checkpoints"), **every})
    assert tandem_run(straight).returncode == 0
    a, b = final_weights(tmp_path, "straight"), final_weights(tmp_path, "crashes")
    assert [name for name in a if not a[name].equal(b[name])] == [], "the restarted run's weights differ"


def test_a_rank_that_always_crashes_fails_the_job_after_backoff_limit_restarts_with_backoff(tmp_path):
    path = manifest(tmp_path, "always", backoffLimit=2,
                    trainer={"model": "userland:crash_on_rank_one", "modelArgs": {}, "evalData": None})
    started = time.monotonic()
    result = tandem_run(path, "--restart-backoff-seconds", "1", timeout=180)
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    status = final_status(result)
    assert (status["phase"], status["restarts"]) == ("Failed", 2)
    assert status["message"] == ("rank 1 exited with code 1; the group was restarted 2 time(s), backoffLimit is 2")
    assert result.stderr.count("RuntimeError: injected failure in rank 1") == 3, "each group's failure is shown"
    assert "restart 1 of 2 from the latest checkpoint in 1 s" in result.stderr
    assert "restart 2 of 2 from the latest checkpoint in 2 s" in result.stderr
    assert elapsed >= 3, "backed off 1 s, then 2 s"
    assert leftover_processes("always") == []


def test_the_active_deadline_stops_the_ranks_with_a_checkpoint_and_fails_the_job(tmp_path, monkeypatch):
    """The deadline must find the ranks training: one that finds them starting up (importing torch, joining the
    group) ends them with nothing to checkpoint (worker/train/signals.py), and on a loaded machine that start-up
    alone may outlast any deadline short enough for a test. So `tandem run` is frozen (SIGSTOP) from the moment its
    ranks exist until rank 0 has published a step (both ranks train: a step takes both): however late that comes,
    the deadline is seen no earlier. Its clock runs on meanwhile, so it may be seen at once."""
    deadline = 6  # from the ranks' start to the freeze is one look at /proc (polled every few tenths of a second)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # `tandem run` keeps rank 0's status file in a temporary directory
    path = manifest(tmp_path, "deadline", activeDeadlineSeconds=deadline, trainer={
        **DROPOUT, "model": "userland:dropout_mlp", "modelArgs": {"step_seconds": 0.05}, "epochs": 500})
    launcher, stderr = start_tandem_run(path)
    wait_for_stderr(launcher, stderr, lambda _: len(leftover_processes("deadline")) == 2)  # both ranks started
    launcher.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: any(status is not None and status.progress.step > 0 for status in map(
            read_status_file, tmp_path.glob("tandem-deadline-*/group-0/status.json"))),
            timeout=120, what="rank 0's first step")
    finally:
        launcher.send_signal(signal.SIGCONT)
    stdout, _ = launcher.communicate(timeout=120)  # a job left to run its 500 epochs would take hours
    assert launcher.returncode == 1, stderr.read_text()
    status = json.loads(stdout)
    assert status["phase"] == "Failed"
    assert status["message"].startswith(f"DeadlineExceeded: the job ran past its activeDeadlineSeconds ({deadline} s)")
    latest = checkpoint.latest(tmp_path / "deadline" / "checkpoints")
    assert latest is not None and status["checkpoint"]["latest"] == str(latest)
    assert 0 < checkpoint.load(latest)["manifest"]["step"] == status["progress"]["step"]
    assert leftover_processes("deadline") == []


def test_a_stop_signal_during_the_backoff_stops_at_once(tmp_path):
    path = manifest(tmp_path, "backoff", trainer={"model": "userland:crash_on_rank_one", "modelArgs": {},
                                                   "evalData": None})
    launcher, stderr = start_tandem_run(path, "--restart-backoff-seconds", "60")
    wait_for_stderr(launcher, stderr, lambda text: "restart 1 of 3" in text)
    signalled = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    stdout, _ = launcher.communicate(timeout=30)
    assert time.monotonic() - signalled < 5, "the stop waited for the backoff"
    assert launcher.returncode == 130, stderr.read_text()
    status = json.loads(stdout)
    assert (status["phase"], status["restarts"]) == ("Suspended", 1)
    assert "while restarting" in status["message"]
    assert leftover_processes("backoff") == []


# Digits: 1438 training examples. At 2 ranks x 16 an epoch is 45 micro-batches of 32 examples; at 1 rank x 16, 90 of
# 16 (the last ones short: 719 - 44 x 16 = 15 and 1438 - 89 x 16 = 14). Each case: the first run's ranks and steps,
# the second run's ranks, then its final step: the steps done, the rest of epoch 1 at the new size (from the first
# example the first run had not taken) and all of epoch 2. Every case sees each example of the two epochs once.
RESIZES = {
    # 2 x 15 x 16 = 480 examples taken; 958 left: 60 micro-batches of 16.
    "2-to-1": ({}, 2, 15, 1, 15 + 60 + 90),
    # 21 x 16 = 336 taken, not a multiple of the new 2 x 16; 1102 left: 551 a rank, 35 micro-batches.
    "1-to-2-sharedGradients": ({"trainingMode": "sharedGradients"}, 1, 21, 2, 21 + 35 + 45),
    # Stopped off an averaging step: each rank's replica differs from the average the checkpoint holds as the model.
    "2-to-1-averaging": ({"trainingMode": "averaging", "averaging": {"frequency": 3}}, 2, 16, 1, 16 + 58 + 90),
}


@pytest.mark.parametrize("case", RESIZES)
def test_a_checkpoint_written_at_another_world_size_resumes_by_examples_seen(tmp_path, case):
    spec, first_workers, first_steps, workers, total = RESIZES[case]
    trainer = {"evalData": None, "epochs": 2}
    result = tandem_run(manifest(tmp_path, "resize", trainer={**trainer, "maxSteps": first_steps}, **spec),
                        "--workers", str(first_workers))
    assert result.returncode == 0, result.stderr

    result = tandem_run(manifest(tmp_path, "resize", trainer=trainer, **spec), "--workers", str(workers))
    assert result.returncode == 0, result.stderr
    status = final_status(result)
    assert status["phase"] == "Succeeded"
    assert status["checkpoint"]["history"][0]["step"] == first_steps, "resumed from the first run's checkpoint"
    assert status["progress"]["step"] == status["progress"]["totalSteps"] == total
    final = checkpoint.load(checkpoint.latest(tmp_path / "resize" / "checkpoints"))
    assert final["manifest"]["world_size"] == workers
    assert (final["position"]["epoch"], final["position"]["samples"]) == (2, 2 * 1438), "each example once an epoch"

    lines = [line for line in result.stderr.splitlines() if "world size and global batch changed" in line]
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert f"(from {first_workers} x 16 x 1 = {16 * first_workers} to {workers} x 16 x 1 = {16 * workers})" in line
    assert f"at step {first_steps}" in line
    assert f"epoch 1 goes on after its first {first_steps * first_workers * 16} examples" in line
    assert "each rank's random generators" in line
    assert ("sharedGradients residuals" in line) == (spec.get("trainingMode") == "sharedGradients")
    assert ("averaging replica" in line) == (spec.get("trainingMode") == "averaging")
