"""Rank 0's report into its job's status (worker/train/reporting.py: KubernetesStatusSink and the Reporter), against
the emulated API server (devcluster/): only rank 0's four fields are written, at most every few seconds but at once
for a checkpoint; an API error never stops training and the status goes again at the next publish; a deleted job
ends reporting quietly; the first status after a resume shows the resumed step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from devcluster import Cluster
from tandem.api import ParallelTrainingJobStatus
from tandem.worker.train.reporting import KubernetesStatusSink, Reporter

GROUP, VERSION, JOBS, NS = "tandem.dev", "v1alpha1", "paralleltrainingjobs", "default"


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    with Cluster(tmp_path, kubelet=False) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": "digits"},
            "spec": {"trainer": {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data"}}})
        cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, JOBS, "digits", {
            "status": {"phase": "Running", "message": "the operator's", "restarts": 2}})
        yield cluster


def stored(cluster: Cluster) -> dict:
    return cluster.get("ptj", NS, "digits")["status"]


def status(step: int, checkpoint: str | None = None) -> ParallelTrainingJobStatus:
    value = ParallelTrainingJobStatus(phase="Succeeded", message="rank 0's own view, never sent")
    value.progress.step, value.progress.total_steps = step, 100
    value.metrics = {"accuracy": 0.5}
    value.checkpoint.latest = checkpoint
    return value


def test_rank_zero_writes_its_four_fields_and_never_the_operators(cluster):
    sink = KubernetesStatusSink("digits", NS, interval=60)
    sink.publish(status(10))
    written = stored(cluster)
    assert written["progress"]["step"] == 10 and written["metrics"] == {"accuracy": 0.5}
    assert (written["phase"], written["message"], written["restarts"]) == ("Running", "the operator's", 2)


def test_updates_are_throttled_except_for_a_new_checkpoint_and_the_end(cluster):
    sink = KubernetesStatusSink("digits", NS, interval=60)
    sink.publish(status(10))
    sink.publish(status(20))
    assert stored(cluster)["progress"]["step"] == 10, "within the interval: held back"
    sink.publish(status(30, checkpoint="/ckpt/step-00000030.pt"))
    assert stored(cluster)["checkpoint"]["latest"] == "/ckpt/step-00000030.pt", "a checkpoint goes at once"
    sink.publish(status(40, checkpoint="/ckpt/step-00000030.pt"))
    sink.close()
    assert stored(cluster)["progress"]["step"] == 40, "the last status goes at the end"


def test_an_api_error_is_logged_and_the_status_goes_again_at_the_next_publish(cluster, capsys):
    sink = KubernetesStatusSink("digits", NS, interval=0)
    status_patches = cluster.emulator["patch", re.compile(".*/status")]
    seen = len(list(status_patches))  # kmock slices count every matching request served, earlier ones too
    status_patches[seen:seen + 1] << 503  # the next status patch only
    sink.publish(status(10))
    assert "status update failed (503" in capsys.readouterr().err
    assert "progress" not in stored(cluster)
    sink.publish(status(11))
    assert stored(cluster)["progress"]["step"] == 11


def test_a_deleted_job_ends_reporting_quietly(cluster, capsys):
    sink = KubernetesStatusSink("digits", NS, interval=0)
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, JOBS, "digits")
    sink.publish(status(10))
    sink.publish(status(11))
    assert sink.gone
    assert capsys.readouterr().err.count("is gone: status reporting ends") == 1


class Recorder:
    def __init__(self) -> None:
        self.published: list[ParallelTrainingJobStatus] = []

    def publish(self, status: ParallelTrainingJobStatus) -> None:
        self.published.append(status.model_copy(deep=True))

    def close(self) -> None:
        pass


def test_the_first_status_after_a_resume_shows_the_resumed_step():
    recorder = Recorder()
    reporter = Reporter([recorder], workers=2, total_steps=100)
    reporter.resumed(Path("/ckpt/step-00000080.pt"), step=80, epoch=4)
    first = recorder.published[0]
    assert (first.progress.step, first.progress.epoch) == (80, 4)
    assert first.checkpoint.latest == "/ckpt/step-00000080.pt"
