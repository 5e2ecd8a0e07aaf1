"""`tandem run` and a checkpoint directory that belongs to one run: a second writer and a fresh start among another
run's checkpoints are refused before any rank starts; `checkpoint.overwrite` moves the other run's files aside, kept
byte for byte; a resumed run says where it resumes; a complete job run again says so and touches nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from jobs import final_status, manifest, tandem_run

from tandem.examples.digits import mlp
from tandem.worker import checkpoint
from tandem.worker import checkpoint_owner as owner

TINY = {"modelArgs": {"hidden": 8}, "evalData": None, "batchSizePerWorker": 64}
OLD_STEPS = (2700, 2780, 2860)


def tiny_job(tmp_path: Path, *, max_steps: int, **checkpoint_settings) -> Path:
    return manifest(tmp_path, "tiny", workers=1, trainer={**TINY, "maxSteps": max_steps},
                    checkpoint={"directory": str(directory_of(tmp_path)), "everySteps": 1, "keepLast": 2,
                                **checkpoint_settings})


def directory_of(tmp_path: Path) -> Path:
    return tmp_path / "tiny" / "checkpoints"


def another_runs_checkpoints(directory: Path) -> dict[str, bytes]:
    """A finished run's checkpoints at higher steps than the tiny job will reach, as the issue found them."""
    directory.mkdir(parents=True)
    owner.write_run(directory, owner.RunRecord(run="old", job="long", started=owner.now()))
    for step in OLD_STEPS:
        manifest_ = checkpoint.build_manifest(model="tandem.examples.digits:mlp", model_args={"hidden": 8}, step=step,
                                              run="old")
        checkpoint.save(directory, {"manifest": manifest_, "model": mlp(hidden=8).state_dict()}, step=step,
                        keep_last=5, run="old")
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in directory.iterdir() if path.is_file()}


def test_a_fresh_start_among_another_runs_checkpoints_is_refused_before_any_rank_starts(tmp_path):
    before = another_runs_checkpoints(directory_of(tmp_path))
    result = tandem_run(tiny_job(tmp_path, max_steps=4, resume=False))
    assert result.returncode == 2, result.stderr
    refusal = (f"CheckpointDirectoryTaken: spec.checkpoint.directory {directory_of(tmp_path)} holds another run's "
               "checkpoints (run old of job long: step-00002700.pt, step-00002780.pt, step-00002860.pt (3 files))")
    assert f"tandem run: Failed: {refusal}" in result.stderr
    assert "spec.checkpoint.overwrite: true" in result.stderr and "another spec.checkpoint.directory" in result.stderr
    status = final_status(result)  # as a cluster's job would fail: with the reason, spending no restart
    assert (status["phase"], status["restarts"]) == ("Failed", 0) and status["message"].startswith(refusal)
    assert {path.name: path.read_bytes() for path in directory_of(tmp_path).iterdir()
            if path.name in before} == before


def test_a_second_writer_is_refused_at_once_naming_the_holder(tmp_path):
    directory = directory_of(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from tandem.worker import checkpoint_owner "
         "as o; o.take_lease(Path(sys.argv[1]), o.this_process('first', 'tiny', None)); print('held', flush=True); "
         "time.sleep(120)", str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        result = tandem_run(tiny_job(tmp_path, max_steps=4))
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2, result.stderr
    assert (f"tandem run: Failed: CheckpointDirectoryTaken: spec.checkpoint.directory {directory} is in use by "
            f"another run: held by pid {holder.pid} on host ") in result.stderr
    assert "(run first, job tiny)" in result.stderr
    assert not list(directory.glob("step-*"))


def test_overwrite_keeps_the_other_run_aside_then_a_rerun_resumes_or_says_it_is_complete(tmp_path):
    directory = directory_of(tmp_path)
    before = another_runs_checkpoints(directory)

    first = tandem_run(tiny_job(tmp_path, max_steps=4, resume=False, overwrite=True))
    assert first.returncode == 0, first.stderr
    assert f"moved another run's checkpoints (step-00002700.pt, step-00002780.pt, step-00002860.pt (3 files)) into " \
           f"{directory / 'run-old'}" in first.stderr
    assert {path.name: path.read_bytes() for path in (directory / "run-old").iterdir()} == before
    assert final_status(first)["checkpoint"]["latest"] == str(directory / "step-00000004.pt")
    assert sorted(path.name for path in directory.glob("step-*")) == ["step-00000003.pt", "step-00000004.pt"]

    files = snapshot(directory)
    again = tandem_run(tiny_job(tmp_path, max_steps=4))
    assert again.returncode == 0, again.stderr
    assert "tandem worker: already complete: step-00000004.pt is at step 4 of 4" in again.stderr
    status = final_status(again)
    assert status["phase"] == "Succeeded" and status["message"].startswith("already complete")
    assert snapshot(directory) == files

    further = tandem_run(tiny_job(tmp_path, max_steps=6))
    assert further.returncode == 0, further.stderr
    assert "tandem worker: resuming from step-00000004.pt (step 4 of 6)" in further.stderr
    assert final_status(further)["progress"]["step"] == 6
    assert {path.name: path.read_bytes() for path in (directory / "run-old").iterdir()} == before


LEASE_CHECK = """
import json, os, sys
from pathlib import Path
lease = json.loads((Path(os.environ["TANDEM_CHECKPOINT_DIR"]) / "tandem-lease.json").read_text())
held = (lease["pid"], lease["run"]) == (os.getppid(), os.environ["TANDEM_RUN_ID"])
print("held by the launcher" if held else f"lease {lease}", file=sys.stderr)
sys.exit(0 if held else 3)
"""


def test_a_custom_command_runs_while_the_launcher_holds_its_directory(tmp_path):
    """A custom command's files are its own (no run recorded), but `tandem run` holds the directory's lease while it
    runs, as for Tandem's trainer: the command finds the lease naming its launcher and the run it was told."""
    path = manifest(tmp_path, "custom", workers=1, trainingMode="custom",
                    custom={"command": [sys.executable, "-c", LEASE_CHECK]})
    result = tandem_run(path)
    assert result.returncode == 0, result.stderr  # (the command exits 3 where the lease is not the launcher's)
    directory = tmp_path / "custom" / "checkpoints"
    assert not (directory / owner.LEASE_FILE).exists() and not (directory / owner.RUN_FILE).exists()
