"""Rank 0's report into its job's status (worker/train/status_sink.py: KubernetesStatusSink, and the Reporter in
reporting.py), against the emulated API server (devcluster/): only rank 0's five fields are written, at most every
few seconds but at once for a checkpoint; a deleted job ends reporting quietly; the first status after a resume shows
the resumed step; a real rank's status carries what a preemption would cost (`preemptionCost`). While the API
misbehaves (faults injected with kmock's DSL: a reaction answers a status patch with an error, a Retry-After, or
holds it): transient errors are retried and the newest status ends up stored, the stored step and checkpoint never go
backwards, the final status gets through refusals, Retry-After is honoured, a stalled API never holds up
`publish()`, a 403 gives one line with the fix, and a restarted group keeps the stored history."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import kmock
import pytest
from jobs import Recorder
from serving import wait_until

from devcluster import Cluster
from tandem.api import ParallelTrainingJob, ParallelTrainingJobStatus
from tandem.api_errors import Backoff, retry_after
from tandem.worker.train import status_sink
from tandem.worker.train.preemption import preemption_cost
from tandem.worker.train.reporting import Reporter
from tandem.worker.train.status_sink import KubernetesStatusSink

GROUP, VERSION, JOBS, NS = "tandem.dev", "v1alpha1", "paralleltrainingjobs", "default"


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    monkeypatch.setattr(status_sink, "BACKOFF", Backoff(base=0.02, cap=4.0))  # retries within a test's second
    with Cluster(tmp_path, kubelet=False) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": "digits"},
            "spec": {"trainer": {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data"}}})
        cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, JOBS, "digits", {
            "status": {"phase": "Running", "message": "the operator's", "restarts": 2}})
        yield cluster


class Answers:
    """Answers rank 0's next status patches in turn from a script, then lets the emulator serve them: a status code
    (a JSON Status with it), a `(code, headers, message)` triple, "hold" (the request waits until `release` is set, at
    most 10 s, then is served), or None (served). Records when each scripted request came (`times`).

    Each request of the script gets two kmock reactions, each for a slice of one request: a callable that records
    (it returns no content, so kmock goes on and disables it), then the answer. One reaction per request because
    kmock 0.8 disables a reaction that once returned no content, and a callable that returns a kmock.Response keeps
    that response's status for the requests after it."""

    def __init__(self, cluster: Cluster, script) -> None:
        self.times: list[float] = []
        self.arrived, self.release = threading.Event(), threading.Event()
        patches = cluster.emulator["patch", re.compile(".*/status")]
        seen = len(list(patches))  # kmock slices count every matching request served, earlier ones too
        for index, step in enumerate(script):
            at = patches[seen + index:seen + index + 1]
            at << self._record
            if step == "hold":
                at << self._hold
            elif step is not None:
                code, headers, message = step if isinstance(step, tuple) else (step, {}, f"injected {step}")
                at << code << kmock.headers(headers) << {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "message": message}

    def _record(self) -> None:
        self.times.append(time.monotonic())

    async def _hold(self) -> None:
        self.arrived.set()
        await asyncio.to_thread(self.release.wait, 10)


def answer(cluster: Cluster, *script) -> Answers:
    return Answers(cluster, script)


def stored(cluster: Cluster) -> dict:
    return cluster.get("ptj", NS, "digits")["status"]


def status(step: int, checkpoint: str | None = None) -> ParallelTrainingJobStatus:
    value = ParallelTrainingJobStatus(phase="Succeeded", message="rank 0's own view, never sent")
    value.progress.step, value.progress.total_steps = step, 100
    value.metrics = {"accuracy": 0.5}
    value.checkpoint.latest = checkpoint
    return value


def test_rank_zero_writes_its_own_fields_and_never_the_operators(cluster):
    sink = KubernetesStatusSink("digits", NS, interval=60)
    sink.publish(status(10))
    assert sink.flush(10)
    written = stored(cluster)
    assert written["progress"]["step"] == 10 and written["metrics"] == {"accuracy": 0.5}
    assert (written["phase"], written["message"], written["restarts"]) == ("Running", "the operator's", 2)
    sink.close()


def test_updates_are_throttled_except_for_a_new_checkpoint_and_the_end(cluster):
    sink = KubernetesStatusSink("digits", NS, interval=60)
    sink.publish(status(10))
    assert sink.flush(10)
    sink.publish(status(20))
    assert sink.flush(10)
    assert stored(cluster)["progress"]["step"] == 10, "within the interval: held back"
    sink.publish(status(30, checkpoint="/ckpt/step-00000030.pt"))
    assert sink.flush(10)
    assert stored(cluster)["checkpoint"]["latest"] == "/ckpt/step-00000030.pt", "a checkpoint goes at once"
    sink.publish(status(40, checkpoint="/ckpt/step-00000030.pt"))
    sink.close()
    assert stored(cluster)["progress"]["step"] == 40, "the last status goes at the end"


def test_an_api_error_is_logged_once_and_the_status_retried_without_a_new_publish(cluster, capsys):
    answers = answer(cluster, 503, 503, None)
    sink = KubernetesStatusSink("digits", NS, interval=60)
    sink.publish(status(10))
    assert sink.flush(10)
    assert stored(cluster)["progress"]["step"] == 10
    assert len(answers.times) == 3
    assert capsys.readouterr().err.count("status update of default/digits failed (503") == 1
    sink.close()


def test_a_deleted_job_ends_reporting_quietly(cluster, capsys):
    sink = KubernetesStatusSink("digits", NS, interval=0)
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, JOBS, "digits")
    sink.publish(status(10))
    sink.flush(10)
    sink.publish(status(11))
    sink.close()
    assert sink.gone
    assert capsys.readouterr().err.count("is gone: status reporting ends") == 1


def test_the_first_status_after_a_resume_shows_the_resumed_step():
    recorder = Recorder()
    reporter = Reporter([recorder], workers=2, total_steps=100)
    reporter.resumed(Path("/ckpt/step-00000080.pt"), step=80, epoch=4)
    first = recorder.published[0]
    assert (first.progress.step, first.progress.epoch) == (80, 4)
    assert first.checkpoint.latest == "/ckpt/step-00000080.pt"


def steps_and_checkpoints(cluster: Cluster) -> tuple[list[int], list[int]]:
    """Over the object's history: the stored progress.step and the step of checkpoint.latest, where set."""
    versions = [v["status"] for v in cluster.history("ptj", NS, "digits") if v and v.get("status")]
    steps = [v["progress"]["step"] for v in versions if "progress" in v]
    checkpoints = [int(v["checkpoint"]["latest"][-7:-3]) for v in versions if (v.get("checkpoint") or {}).get("latest")]
    return steps, checkpoints


def faulty_run(cluster: Cluster) -> None:
    """60 steps published as a training loop does (a checkpoint every 10) while two thirds of the first 12 patches
    get 503 or 429; the sink sends every status due at once (interval 0)."""
    answers = answer(cluster, *[[503, None, (429, {"Retry-After": "0"}, "slow down")][i % 3] for i in range(12)])
    sink = KubernetesStatusSink("digits", NS, interval=0)
    for step in range(1, 61):
        latest = step - step % 10
        sink.publish(status(step, checkpoint=f"/ckpt/step-{latest:04d}.pt" if latest else None))
        time.sleep(0.005)
    sink.close()
    assert len(answers.times) == 12, "every fault was served"


def test_through_503s_and_429s_the_newest_status_is_stored_and_the_step_never_decreases(cluster):
    faulty_run(cluster)
    assert stored(cluster)["progress"]["step"] == 60
    steps, _ = steps_and_checkpoints(cluster)
    assert len(steps) > 1 and steps == sorted(steps)


def test_through_503s_and_429s_the_latest_checkpoint_never_regresses(cluster):
    faulty_run(cluster)
    _, checkpoints = steps_and_checkpoints(cluster)
    assert checkpoints[-1] == 60 and checkpoints == sorted(checkpoints)


class Waits(threading.Condition):
    """A threading.Condition that records the timeout of each `wait_for` and the thread that asked for it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[tuple[threading.Thread, float | None]] = []

    def wait_for(self, predicate, timeout=None):
        self.asked.append((threading.current_thread(), timeout))
        return super().wait_for(predicate, timeout)

    def timeouts(self, thread: threading.Thread) -> list[float]:
        """What `thread` asked to wait at most, in order (a wait for a change alone asks no timeout)."""
        return [timeout for by, timeout in self.asked if by is thread and timeout is not None]


def sink_recording_waits(monkeypatch, **options) -> tuple[KubernetesStatusSink, Waits]:
    """A sink whose condition (`_wake`: the one its sender waits on between attempts, and close() for the final
    status) is a `Waits`, so that the delays the sender chooses and the time close() allows are recorded as asked
    rather than measured: a loaded machine stretches what is measured, never what is asked. threading.Condition is
    replaced only while the sink is built."""
    with monkeypatch.context() as patch:
        patch.setattr(status_sink.threading, "Condition", Waits)
        sink = KubernetesStatusSink("digits", NS, **options)
    return sink, sink._wake


def test_the_final_status_is_delivered_through_three_refusals_in_a_row(cluster, monkeypatch, capsys):
    """close() allows the final status the whole deadline it was given (the timeout it asks, recorded), so it does
    not give up while the retries are within it."""
    sink, waits = sink_recording_waits(monkeypatch, interval=60)
    sink.publish(status(10))
    assert sink.flush(10)
    answers = answer(cluster, 503, 503, 503, None)
    sink.publish(status(40))  # within the interval: held back until close
    sink.close()
    assert len(answers.times) == 4
    assert stored(cluster)["progress"]["step"] == 40
    assert "not delivered" not in capsys.readouterr().err
    assert waits.timeouts(threading.current_thread())[-1] == sink.deadline == 30.0


@pytest.mark.parametrize(("script", "first_wait", "last_error"), [
    pytest.param([503] * 100, (0.01, 0.02), "503", id="503s"),
    pytest.param([(429, {"Retry-After": "600"}, "slow down")], (status_sink.RETRY_AFTER_CAP,) * 2, "429",
                 id="a-retry-after-past-the-cap"),
])
def test_close_gives_up_at_its_deadline_with_one_line(cluster, monkeypatch, capsys, script, first_wait, last_error):
    """While every attempt fails, close() waits for the final status exactly the deadline it was given (the timeout
    it asks of the sink's condition, recorded rather than measured), then gives up with one line naming the last
    error, and the sender stops at once, in the middle of a wait too: a Retry-After of 600 s is waited at most
    RETRY_AFTER_CAP (30 s), and close() cuts that short."""
    answers = answer(cluster, *script)
    sink, waits = sink_recording_waits(monkeypatch, interval=60, deadline=0.5)
    sink.publish(status(10))
    wait_until(lambda: answers.times, timeout=10, what="the first status patch")  # retrying before close()
    sink.close()
    sink._thread.join(10)
    assert not sink._thread.is_alive(), "the sender stopped when close() gave up"
    assert waits.timeouts(threading.current_thread()) == [0.5]
    low, high = first_wait
    assert low <= waits.timeouts(sink._thread)[0] <= high
    line = f"the final status of default/digits was not delivered within 0.5 s (last error: {last_error}"
    assert capsys.readouterr().err.count(line) == 1
    assert "progress" not in stored(cluster)


@pytest.mark.parametrize(("script", "expected"), [
    pytest.param([503, 503, 503, 503], [(0.01, 0.02), (0.02, 0.04), (0.04, 0.08), (0.08, 0.16)], id="503s"),
    pytest.param([(429, {"Retry-After": "1"}, "slow down"), 503, 503], [(1.0, 1.0), (0.02, 0.04), (0.04, 0.08)],
                 id="a-429-with-retry-after-then-503s"),
    pytest.param([503, 503, None, 503], [(0.01, 0.02), (0.02, 0.04), (0.01, 0.02)], id="started-over-after-a-success"),
])
def test_the_senders_wait_doubles_over_failures_in_a_row_and_starts_over_after_a_success(cluster, monkeypatch,
                                                                                          script, expected):
    """The delays rank 0's sender asks between attempts (recorded, not measured; the jitter is real) while it sends
    two statuses, the second once the first is stored, through the script's answers: under the cluster fixture's
    backoff (base 0.02 s: the n-th failure in a row waits between 0.01 x 2^(n-1) and 0.02 x 2^(n-1) s), each failure
    doubles the wait, a 429's Retry-After is the least it waits without changing the count, and a delivered status
    starts the next one's count over."""
    answers = answer(cluster, *script)
    sink, waits = sink_recording_waits(monkeypatch, interval=0)
    sink.publish(status(10))
    assert sink.flush(10)
    sink.publish(status(20))
    assert sink.flush(10)
    sink.close()
    assert len(answers.times) == len(script)
    assert stored(cluster)["progress"]["step"] == 20
    asked = waits.timeouts(sink._thread)
    assert len(asked) == len(expected), asked
    assert all(low <= wait <= high for wait, (low, high) in zip(asked, expected, strict=True)), asked


def test_retry_after_is_honoured(cluster):
    answers = answer(cluster, (429, {"Retry-After": "1"}, "too many requests"), None)
    sink = KubernetesStatusSink("digits", NS, interval=0)
    sink.publish(status(10))
    assert sink.flush(10)
    assert len(answers.times) == 2
    assert answers.times[1] - answers.times[0] >= 1.0
    assert stored(cluster)["progress"]["step"] == 10
    sink.close()


def test_the_status_details_retry_after_seconds_is_honoured_too():
    from kubernetes.client.exceptions import ApiException

    error = ApiException(status=429, reason="Too Many Requests")
    error.body = '{"kind": "Status", "code": 429, "details": {"retryAfterSeconds": 3}}'
    assert retry_after(error) == 3.0


def test_a_stalled_api_does_not_hold_up_publish(cluster):
    """publish() returns while the API holds the sender's request unanswered; the newest status goes after it."""
    answers = answer(cluster, "hold")
    sink = KubernetesStatusSink("digits", NS, interval=0, timeout=30)
    sink.publish(status(10))
    assert answers.arrived.wait(10), "the sender's patch reached the API"
    for step in range(11, 31):
        sink.publish(status(step, checkpoint=f"/ckpt/step-{step:04d}.pt"))
    held = not answers.release.is_set()
    answers.release.set()
    assert held, "every publish returned while the patch was held"
    assert sink.flush(10)
    assert stored(cluster)["progress"]["step"] == 30
    sink.close()


def test_a_403_gives_one_line_with_the_fix_and_the_next_status_is_tried_once_more(cluster, capsys):
    message = ('paralleltrainingjobs.tandem.dev "digits" is forbidden: User "system:serviceaccount:default:digits-'
               'rank0" cannot patch resource "paralleltrainingjobs/status" in API group "tandem.dev"')
    answers = answer(cluster, (403, {}, message))
    sink = KubernetesStatusSink("digits", NS, interval=0)
    sink.publish(status(10))
    assert sink.flush(10)
    assert len(answers.times) == 1, "not retried"
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert "default/digits" in lines[0] and message in lines[0]
    assert "rank 0's ServiceAccount lacks `patch` on paralleltrainingjobs/status" in lines[0]
    sink.publish(status(11))
    sink.close()
    assert stored(cluster)["progress"]["step"] == 11


def restarted(cluster: Cluster) -> list[str]:
    """The status a group left behind: step 37, three checkpoints, accuracy measured."""
    paths = [f"/ckpt/step-{step:04d}.pt" for step in (10, 20, 30)]
    cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, NS, JOBS, "digits", {"status": {
        "progress": {"step": 37, "totalSteps": 100}, "metrics": {"accuracy": 0.9},
        "checkpoint": {"latest": paths[-1], "step": 30, "time": "2026-01-01T00:00:30Z",
                       "history": [{"path": p, "step": int(p[-7:-3]), "time": f"2026-01-01T00:00:{p[-5:-3]}Z"}
                                   for p in paths]}}})
    return paths


def test_a_restarted_groups_first_patch_keeps_the_stored_checkpoints(cluster):
    paths = restarted(cluster)
    sink = KubernetesStatusSink("digits", NS, interval=0)
    reporter = Reporter([sink], workers=2, total_steps=100)
    reporter.resumed(Path(paths[-1]), step=30, epoch=2)
    assert sink.flush(10)
    written = stored(cluster)
    assert written["progress"]["step"] == 30, "the resumed step"
    assert written["metrics"] == {"accuracy": 0.9}
    assert written["checkpoint"]["latest"] == paths[-1]
    assert written["checkpoint"]["time"] == "2026-01-01T00:00:30Z", "when it was written, not when resumed"
    assert [record["path"] for record in written["checkpoint"]["history"]] == paths
    reporter.checkpoint(Path("/ckpt/step-0040.pt"), 40)
    sink.close()
    assert [record["path"] for record in stored(cluster)["checkpoint"]["history"]] == [*paths, "/ckpt/step-0040.pt"]


def test_a_group_restarted_from_scratch_removes_no_checkpoint(cluster):
    paths = restarted(cluster)
    sink = KubernetesStatusSink("digits", NS, interval=0)
    reporter = Reporter([sink], workers=2, total_steps=100)
    reporter.progress(epoch=1, step=1, loss=2.3, samples=64)
    sink.close()
    assert stored(cluster)["progress"]["step"] == 1
    versions = [v["status"] for v in cluster.history("ptj", NS, "digits") if v and "checkpoint" in v.get("status", {})]
    assert len(versions) >= 2, "the restart's patch and rank 0's"
    for version in versions:
        assert version["checkpoint"]["latest"] == paths[-1]
        assert [record["path"] for record in version["checkpoint"]["history"]] == paths


LIMIT = status_sink.HISTORY_LIMIT
FULL = [10 * n for n in range(1, LIMIT + 1)]
"""A stored history at its limit: steps 10, 20, ... 10 x LIMIT."""


@pytest.mark.parametrize(("stored", "written", "kept"), [
    ([], [*range(1, LIMIT + 2)], [*range(2, LIMIT + 2)]),
    (FULL, [FULL[-1] + 10], [*FULL[1:], FULL[-1] + 10]),
    (FULL, [FULL[-1], FULL[-1] + 10], [*FULL[1:], FULL[-1] + 10]),
], ids=["one group writes one checkpoint past the limit", "a restarted group's first checkpoint after a full history",
        "a resumed group records the stored latest again, then a new one"])
def test_the_checkpoint_history_past_its_limit_keeps_the_newest(stored, written, kept):
    """What rank 0 records (Reporter.checkpoint) and what its patch sends over the stored history (keep_stored_history):
    the newest HISTORY_LIMIT records, oldest first."""
    recorder = Recorder()
    reporter = Reporter([recorder], workers=2, total_steps=1000)
    for step in written:
        reporter.checkpoint(Path(f"/ckpt/step-{step:04d}.pt"), step)
    own = recorder.published[-1].to_dict()["checkpoint"]
    history = [{"path": f"/ckpt/step-{step:04d}.pt", "step": step, "time": "2026-01-01T00:00:00Z"} for step in stored]
    merged = status_sink.keep_stored_history({"history": history}, own)
    assert [record["step"] for record in merged["history"]] == kept


def test_a_status_behind_the_one_handed_over_keeps_its_preemption_cost_consistent_with_what_is_sent(cluster):
    """The sink never sends an older step or checkpoint than it handed over; the preemption cost it sends is the one
    of the step and checkpoint it sends."""
    def with_cost(step: int, checkpointed: int, seconds: float) -> ParallelTrainingJobStatus:
        value = status(step, checkpoint=f"/ckpt/step-{checkpointed:04d}.pt")
        value.checkpoint.step = checkpointed
        value.preemption_cost = preemption_cost(value, seconds)
        return value

    sink = KubernetesStatusSink("digits", NS, interval=0)
    sink.publish(with_cost(20, 15, 0.5))
    sink.publish(with_cost(12, 10, 0.25))
    sink.close()
    written = stored(cluster)
    assert (written["progress"]["step"], written["checkpoint"]["step"]) == (20, 15)
    assert written["preemptionCost"] == {"stepsSinceCheckpoint": 5, "checkpointSeconds": 0.5}


def test_a_real_ranks_status_carries_its_preemption_cost(cluster, tmp_path):
    """One rank of `tandem worker train` on the cluster's contract (TANDEM_NAMESPACE: the Kubernetes sink), 25 steps
    with a checkpoint every 10: every stored version's preemptionCost counts the steps since its checkpoint (all the
    steps before the first), and once a checkpoint is stored, how long it took to write."""
    job = cluster.get("ptj", NS, "digits")
    job["spec"]["trainer"].update({"modelArgs": {"hidden": 16}, "batchSizePerWorker": 16, "maxSteps": 25})
    job["spec"]["checkpoint"] = {"everySteps": 10}
    spec = tmp_path / "digits.json"
    spec.write_text(ParallelTrainingJob.model_validate({key: job[key] for key in ("apiVersion", "kind", "spec")} | {
        "metadata": {"name": "digits", "namespace": NS}}).model_dump_json(by_alias=True))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TANDEM_SPEC": str(spec), "TANDEM_JOB": "digits",
           "TANDEM_NAMESPACE": NS, "TANDEM_CHECKPOINT_DIR": str(tmp_path / "checkpoints")}
    result = subprocess.run([sys.executable, "-m", "tandem.cli", "worker", "train"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr

    final = stored(cluster)
    assert (final["progress"]["step"], final["checkpoint"]["step"]) == (25, 25)
    assert final["preemptionCost"]["stepsSinceCheckpoint"] == 0
    assert 0 < final["preemptionCost"]["checkpointSeconds"] < 60
    versions = [v["status"] for v in cluster.history("ptj", NS, "digits")
                if v and "preemptionCost" in v.get("status", {})]
    checkpointed = [v["checkpoint"]["step"] for v in versions if (v.get("checkpoint") or {}).get("latest")]
    assert checkpointed and set(checkpointed) <= {10, 20, 25}, checkpointed
    at_stake = []
    for version in versions:
        checkpoint, cost = version.get("checkpoint") or {}, version["preemptionCost"]
        since = checkpoint["step"] if checkpoint.get("latest") else 0
        assert cost["stepsSinceCheckpoint"] == version["progress"]["step"] - since, json.dumps(version)
        assert ("checkpointSeconds" in cost) == bool(checkpoint.get("latest")), json.dumps(version)
        at_stake.append(cost["stepsSinceCheckpoint"])
    assert at_stake[0] > 0, "the first status, before any checkpoint, has every step done at stake"
