"""Fail fast, and once (issue 36): a model or data that cannot work is named with the fix before anything trains, and
ends the job Failed (InvalidModelOrData) in one attempt, spending no `backoffLimit`: under `tandem run` (its own
check, and a rank's), on the emulated cluster (rank 0's check, or a custom command's, read by the operator), and in
`tandem validate`. So does a checkpoint directory rank 0 refuses on the cluster (CheckpointDirectoryTaken)."""

from __future__ import annotations

import numpy as np
import pytest
from jobs import ROOT, final_status, manifest, tandem_run
from operator_runs import (
    GROUP,
    JOBS,
    NS,
    STARTUP,
    VERSION,
    claim,
    cluster_with_operator,
    custom_job,
    events,
    job_pods,
)

from devcluster import Cluster
from tandem.cli import main
from tandem.worker import checkpoint_owner as owner

FEATURES = "InvalidModelOrData: spec.trainer.data: data has 32 features, the model expects 64 (its first layer, 0: " \
           "Linear): give the model 32 inputs (spec.trainer.modelArgs) or data with 64 features"


def narrow_npz(tmp_path, **arrays) -> str:
    path = tmp_path / "narrow.npz"
    np.savez(path, **(arrays or {"x": np.zeros((64, 32), np.float32), "y": np.zeros(64, np.int64)}))
    return str(path)


def test_a_shape_mismatch_fails_tandem_run_before_any_rank_starts(tmp_path):
    result = tandem_run(manifest(tmp_path, "narrow", backoffLimit=3,
                                 trainer={"data": narrow_npz(tmp_path), "evalData": None}), timeout=120)
    assert result.returncode == 2, result.stderr
    status = final_status(result)
    assert (status["phase"], status["restarts"]) == ("Failed", 0)
    head, frame = status["message"].splitlines()
    assert head == FEATURES
    assert frame.startswith("  raised at tandem/worker/train/preflight.py:")
    assert f"tandem run: Failed: {FEATURES}" in result.stderr
    assert "rank 0" not in result.stderr, "no rank started"


def test_a_data_file_without_x_is_named(tmp_path):
    data = narrow_npz(tmp_path, features=np.zeros((64, 64), np.float32), y=np.zeros(64, np.int64))
    result = tandem_run(manifest(tmp_path, "nox", trainer={"data": data, "evalData": None}), timeout=120)
    assert result.returncode == 2, result.stderr
    assert final_status(result)["message"].startswith(
        f"InvalidModelOrData: spec.trainer.data: {data}: a data file needs arrays x and y; missing ['x'] (it holds "
        "['features', 'y']): save the examples as x and their labels or targets as y, numpy.savez(path, x=..., y=...)")


def test_a_rank_that_finds_the_data_invalid_fails_the_run_in_one_attempt(tmp_path):
    """Data that passed `tandem run`'s check but not rank 0's: the rank's exit code and report end the job at once."""
    result = tandem_run(manifest(tmp_path, "changed", workers=1, backoffLimit=3,
                                 trainer={"data": "narrow_data:narrow_in_ranks", "evalData": None}), timeout=180)
    assert result.returncode == 1, result.stderr
    status = final_status(result)
    assert (status["phase"], status["restarts"]) == ("Failed", 0)
    lines = status["message"].splitlines()
    assert lines[0] == FEATURES
    assert lines[1].startswith("  raised at tandem/worker/train/preflight.py:")
    assert lines[2] == "rank 0 exited with code 78; not restarted: a restart would fail the same way (fix the job's " \
                       "spec)"
    assert "Restarting" not in result.stderr


def test_tandem_validate_refuses_a_model_reference_that_does_not_resolve(tmp_path, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text("apiVersion: tandem.dev/v1alpha1\nkind: ParallelTrainingJob\nmetadata: {name: typo}\n"
                    "spec:\n  trainer: {model: tandem.examples.digit:mlp, data: tandem.examples.digits:train_data}\n")
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text("apiVersion: tandem.dev/v1alpha1\nkind: ParallelTrainingJob\nmetadata: {name: elsewhere}\n"
                         "spec:\n  trainer: {model: tandem.examples.digit:mlp, data: /data/train.npz}\n")
    assert main(["validate", str(typo), str(elsewhere)]) == 1
    shown = capsys.readouterr()
    assert shown.err.strip() == (
        f"{typo}: ParallelTrainingJob/typo: InvalidModelOrData: spec.trainer.model: cannot import module "
        "'tandem.examples.digit' of 'tandem.examples.digit:mlp': ModuleNotFoundError: No module named "
        "'tandem.examples.digit'; did you mean 'tandem.examples.digits'?")
    assert shown.out.strip() == (
        f"{elsewhere}: ParallelTrainingJob/elsewhere is valid (its model and data are not checked: '/data/train.npz' "
        "is not on this machine; --deep checks them)")
    assert main(["validate", "--deep", str(elsewhere)]) == 1
    assert "InvalidModelOrData: spec.trainer.model: cannot import module 'tandem.examples.digit'" in \
        capsys.readouterr().err


def test_the_readmes_validate_example_runs_as_shown(tmp_path, monkeypatch, capsys):
    readme = (ROOT / "README.md").read_text()
    shown = readme.split("    $ tandem validate typo.yaml\n", 1)[1].split("\n\n", 1)[0].strip()
    (tmp_path / "typo.yaml").write_text(
        "apiVersion: tandem.dev/v1alpha1\nkind: ParallelTrainingJob\nmetadata: {name: typo}\n"
        "spec:\n  trainer: {model: tandem.examples.digit:mlp, data: tandem.examples.digits:train_data}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "typo.yaml"]) == 1
    assert capsys.readouterr().err.strip() == shown


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with cluster_with_operator(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


def wait_failed(cluster: Cluster, name: str) -> dict:
    def failed():
        status = (cluster.get("ptj", NS, name) or {}).get("status") or {}
        return status if status.get("phase") == "Failed" else None

    return cluster.wait_for(failed, STARTUP, f"{name} to fail")


def assert_failed_in_one_attempt(cluster: Cluster, name: str, status: dict, reason: str) -> None:
    """`name` failed with `reason` (its Failed condition and last Event) in its first group, never restarted."""
    assert status["restarts"] == 0
    assert next(c for c in status["conditions"] if c["type"] == "Failed")["reason"] == reason
    assert {pod["metadata"]["labels"]["tandem.dev/group"] for pod in job_pods(cluster, name)} == {"0"}
    cluster.wait_for(lambda: events(cluster, name)[-1:] == [reason], 10, "the Failed Event")
    assert "Restarting" not in events(cluster, name)


def test_a_shape_mismatch_on_the_cluster_fails_the_job_in_one_attempt(cluster):
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": "narrow"},
        "spec": {"workers": 1, "backoffLimit": 3,
                 "trainer": {"model": "tandem.examples.digits:mlp", "data": "narrow_data:narrow_data"}}})

    status = wait_failed(cluster, "narrow")
    assert_failed_in_one_attempt(cluster, "narrow", status, "InvalidModelOrData")
    lines = status["message"].splitlines()
    assert lines[0] == FEATURES, status["message"]
    assert lines[1].startswith("  raised at tandem/worker/train/preflight.py:")
    assert lines[2] == "rank 0 (pod narrow-worker-0) exited with code 78; not restarted: a restart would fail the " \
                       "same way (fix the job's spec)"


def test_a_custom_command_that_cannot_start_fails_the_job_on_the_cluster_in_one_attempt(cluster):
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, custom_job(
        "unimportable", ["python", "-m", "no_such_trainer_module"], workers=1, backoffLimit=3))
    status = wait_failed(cluster, "unimportable")
    assert status["restarts"] == 0
    lines = status["message"].splitlines()
    assert lines[0] == ("InvalidModelOrData: spec.custom.command: python cannot import module "
                        "'no_such_trainer_module' (`-m no_such_trainer_module`): install it in the image, or put its "
                        "directory on PYTHONPATH")
    assert lines[-1].startswith("rank 0 (pod unimportable-worker-0) exited with code 78; not restarted")


def test_a_checkpoint_directory_holding_another_run_fails_the_job_on_the_cluster_in_one_attempt(cluster):
    """Rank 0 refuses to start afresh among another run's checkpoints (checkpoint.resume false, no overwrite): the job
    fails at once with CheckpointDirectoryTaken and the refusal's fix, spending no restart (each would be refused the
    same way), and the other run's files are left as they were."""
    claim(cluster, "taken-checkpoints")
    directory = cluster.kubelet.claim_dir(NS, "taken-checkpoints") / "taken"
    directory.mkdir(parents=True)
    owner.write_run(directory, owner.RunRecord(run="old", job="long", started=owner.now(),
                                               checkpoints=["step-00002860.pt"]))
    (directory / "step-00002860.pt").write_bytes(b"another run's weights")
    before = {path.name: path.read_bytes() for path in directory.iterdir()}
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": "taken"},
        "spec": {"workers": 1, "backoffLimit": 3,
                 "trainer": {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data"},
                 "checkpoint": {"directory": "taken", "persistentVolumeClaim": "taken-checkpoints",
                                "resume": False}}})

    status = wait_failed(cluster, "taken")
    assert_failed_in_one_attempt(cluster, "taken", status, "CheckpointDirectoryTaken")
    lines = status["message"].splitlines()
    assert lines[0].startswith(  # (the emulated kubelet maps the claim's mount path to its directory here)
        f"CheckpointDirectoryTaken: spec.checkpoint.directory {directory} holds another run's checkpoints (run old of "
        "job long: step-00002860.pt (1 file)) and spec.checkpoint.resume is false"), lines
    assert "Give this job another spec.checkpoint.directory, or delete them, or set spec.checkpoint.overwrite: true" \
        in lines[0]
    assert lines[-1] == "rank 0 (pod taken-worker-0) exited with code 78; not restarted: a restart would fail the " \
                        "same way (fix the job's spec)"
    assert {path.name: path.read_bytes() for path in directory.iterdir() if path.name in before} == before
    assert owner.LEASE_FILE not in {path.name for path in directory.iterdir()}, "the refused rank released the lease"
