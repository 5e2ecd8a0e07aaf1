"""Gated promotion's decisions, without servers: the gate (worker/serve/promotion.py) as a table, the checkpoint a
gated server starts on, the API fields (fromTrainingJob.promote and .checkpoint), where a pinned server reads its
model, and what the operator makes of the servers' reports (operator/pools.py and pool_served.py: status.model.metrics,
status.lastSkipped, Promoted and PromotionSkipped Events, the pinned Deployment)."""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml
from jobs import ROOT
from test_pool_reconcile import IMAGE, MODEL_MOUNT, NOW, ago, everything, job, pool

from devcluster.patches import json_patch
from tandem.api.inference import FromTrainingJob, Promotion
from tandem.contract import checkpoint_step
from tandem.manifest import ManifestError, merge_patched, parse
from tandem.operator.daemon import OPERATOR_FIELDS
from tandem.operator.observed import read_resource
from tandem.operator.pool_served import Served, served_metrics, skipped_candidate
from tandem.operator.pools import reconcile_pool
from tandem.worker.serve import promotion
from tandem.worker.serve.model_loading import ModelLoadError, locate

ACCURACY = Promotion(metric="accuracy")
LOSS = Promotion(metric="evalLoss", mode="min")

# (name, gate, candidate's metrics, served's metrics, promoted, reason)
GATES = [
    ("max: higher promotes", ACCURACY, {"accuracy": 0.91}, {"accuracy": 0.90}, True,
     "accuracy 0.91 is above the served 0.9"),
    ("max: lower is skipped", ACCURACY, {"accuracy": 0.42}, {"accuracy": 0.90}, False,
     "accuracy 0.42 is not above the served 0.9"),
    ("max: equal is skipped", ACCURACY, {"accuracy": 0.90}, {"accuracy": 0.90}, False,
     "accuracy 0.9 is not above the served 0.9"),
    ("min: lower loss promotes", LOSS, {"evalLoss": 0.2}, {"evalLoss": 0.3}, True,
     "evalLoss 0.2 is below the served 0.3"),
    ("min: higher loss is skipped", LOSS, {"evalLoss": 0.4}, {"evalLoss": 0.3}, False,
     "evalLoss 0.4 is not below the served 0.3"),
    ("min: equal loss is skipped", LOSS, {"evalLoss": 0.3}, {"evalLoss": 0.3}, False,
     "evalLoss 0.3 is not below the served 0.3"),
    ("minDelta: a gain within it is skipped", Promotion(metric="accuracy", min_delta=0.05), {"accuracy": 0.94},
     {"accuracy": 0.90}, False, "accuracy 0.94 is not above the served 0.9 by more than 0.05"),
    ("minDelta: a gain past it promotes", Promotion(metric="accuracy", min_delta=0.05), {"accuracy": 0.96},
     {"accuracy": 0.90}, True, "accuracy 0.96 is above the served 0.9 by more than 0.05"),
    ("minDelta on a loss", Promotion(metric="evalLoss", mode="min", min_delta=0.1), {"evalLoss": 0.25},
     {"evalLoss": 0.3}, False, "evalLoss 0.25 is not below the served 0.3 by more than 0.1"),
    ("a candidate without the metric is skipped, saying so", ACCURACY, {"evalLoss": 0.1}, {"accuracy": 0.9}, False,
     "it has no recorded accuracy (its metrics: evalLoss; does the job set evalData?)"),
    ("a candidate with no metrics at all", ACCURACY, {}, {"accuracy": 0.9}, False,
     "it has no recorded accuracy (its metrics: none; does the job set evalData?)"),
    ("a served checkpoint without the metric yields to one with it", ACCURACY, {"accuracy": 0.1}, {}, True,
     "accuracy 0.1, and the served checkpoint has none recorded"),
]


@pytest.mark.parametrize(("name", "gate", "candidate", "served", "promoted", "reason"), GATES,
                         ids=[g[0] for g in GATES])
def test_the_gate(name, gate, candidate, served, promoted, reason):
    verdict = promotion.judge(gate, candidate, served)
    assert (verdict.promote, verdict.reason) == (promoted, reason)
    assert verdict.metric == candidate.get(gate.metric)


@pytest.mark.parametrize(("gate", "candidates", "expected"), [
    (ACCURACY, [("a", {"accuracy": 0.5}), ("b", {"accuracy": 0.9}), ("c", {"accuracy": 0.4})], "b"),
    (ACCURACY, [("a", {"accuracy": 0.9}), ("b", {"accuracy": 0.9})], "b"),  # the newest of equals
    (LOSS, [("a", {"evalLoss": 0.5}), ("b", {"evalLoss": 0.2}), ("c", {"evalLoss": 0.3})], "b"),
    (LOSS, [("a", {"evalLoss": 0.2}), ("b", {"evalLoss": 0.2})], "b"),  # min mode too: the newest of equals
    (ACCURACY, [("a", {}), ("b", {"accuracy": 0.3}), ("c", {})], "b"),
    (ACCURACY, [("a", {}), ("b", {"evalLoss": 0.3})], None),  # none has it: the server starts on the latest
    (ACCURACY, [], None),
])
def test_a_gated_server_starts_on_the_best_recorded_checkpoint(gate, candidates, expected):
    assert promotion.best(gate, candidates) == expected


@pytest.mark.parametrize(("manifest", "expected"), [
    ({"metrics": {"accuracy": 0.9, "evalLoss": 1}}, {"accuracy": 0.9, "evalLoss": 1.0}),
    ({}, {}),  # a checkpoint written before metrics were recorded
    ({"metrics": "0.9"}, {}),
    ({"metrics": {"accuracy": float("nan"), "flag": True, "note": "x", "evalLoss": 0.5}}, {"evalLoss": 0.5}),
])
def test_recorded_metrics_are_the_manifests_finite_numbers(manifest, expected):
    assert promotion.recorded_metrics(manifest) == expected


def test_the_api_names_the_fields_and_refuses_a_pin_with_a_gate():
    source = FromTrainingJob.model_validate({"name": "train", "promote": {"metric": "accuracy", "minDelta": 0.01}})
    assert (source.promote.mode, source.promote.min_delta) == ("max", 0.01)
    with pytest.raises(ValueError, match="set at most one"):
        FromTrainingJob.model_validate({"name": "train", "checkpoint": "step-00000200.pt", "promote": {
            "metric": "accuracy"}})
    with pytest.raises(ValueError, match="it needs follow: true"):
        FromTrainingJob.model_validate({"name": "train", "follow": False, "promote": {"metric": "accuracy"}})
    for bad, field in (({"checkpoint": "../step-00000200.pt"}, "checkpoint"),
                       ({"promote": {"metric": "accuracy", "mode": "up"}}, "mode"),
                       ({"promote": {"metric": "accuracy", "minDelta": -1}}, "minDelta")):
        body = pool(model={"fromTrainingJob": {"name": "train", **bad}, "inputShape": [64]})
        with pytest.raises(ManifestError) as error:
            parse({k: body[k] for k in ("apiVersion", "kind", "metadata", "spec")})
        assert any(field in problem for problem in error.value.problems), error.value.problems


@pytest.mark.parametrize(("name", "step"), [("step-00000200.pt", 200), ("step-123456789.pt", 123456789),
                                            ("step-x.pt", None), ("model.pt", None), ("step-00000200.pth", None)])
def test_checkpoint_step(name, step):
    assert checkpoint_step(name) == step


def test_a_pinned_pool_reads_the_named_checkpoint_of_the_directory_and_does_not_follow(tmp_path):
    from tandem.api.inference import ModelSource

    (tmp_path / "step-00000010.pt").write_bytes(b"")
    model = ModelSource.model_validate({"fromTrainingJob": {"name": "train", "checkpoint": "step-00000010.pt"}})
    location = locate(model, str(tmp_path))
    assert (location.checkpoint, location.directory, location.follow) == (tmp_path / "step-00000010.pt", None, False)
    missing = ModelSource.model_validate({"fromTrainingJob": {"name": "train", "checkpoint": "step-00000020.pt"}})
    with pytest.raises(ModelLoadError, match=r"fromTrainingJob.checkpoint step-00000020.pt: no such checkpoint in .* "
                                             r"\(there: step-00000010.pt\)"):
        locate(missing, str(tmp_path))


@pytest.mark.parametrize(("parameters", "metrics", "skipped"), [
    ({"checkpoint": "/m/step-00000020.pt", "metric.accuracy": 0.9, "metric.evalLoss": 0.3},
     {"accuracy": 0.9, "evalLoss": 0.3}, None),
    ({"metric.": 1.0, "metric.flag": True, "metric.text": "0.5"}, {}, None),
    ({"skipped_checkpoint": "/m/step-00000030.pt", "skipped_reason": "worse", "skipped_metric": 0.4}, {},
     {"checkpoint": "/m/step-00000030.pt", "reason": "worse", "metric": 0.4}),
    ({"skipped_checkpoint": "/m/step-00000030.pt", "skipped_reason": "it has no recorded accuracy"}, {},
     {"checkpoint": "/m/step-00000030.pt", "reason": "it has no recorded accuracy"}),
    ({"skipped_checkpoint": 7}, {}, None),
])
def test_what_the_operator_reads_from_a_servers_answer(parameters, metrics, skipped):
    assert (served_metrics(parameters), skipped_candidate(parameters)) == (metrics, skipped)


GATED = {"fromTrainingJob": {"name": "train", "promote": {"metric": "accuracy"}}, "inputShape": [64]}


def reporting(step: int, accuracy: float, skipped: tuple[int, float | None] | None = None, pod: str = "a") -> Served:
    report = None
    if skipped is not None:
        report = {"checkpoint": f"{MODEL_MOUNT}/digits/step-{skipped[0]:08d}.pt", "reason": "not above"}
        if skipped[1] is not None:
            report["metric"] = skipped[1]
    return Served(f"digits-server-{pod}", f"{MODEL_MOUNT}/digits/step-{step:08d}.pt", "fromTrainingJob/train",
                  ago(5), metrics={"accuracy": accuracy}, skipped=report)


def gated_pass(status: dict, reports: list[Served]):
    body = pool({"observedGeneration": 1, "phase": "Ready", **status}, model=GATED)
    steady = copy.deepcopy(body)
    return reconcile_pool(read_resource(body), everything(steady), [], reports, job(), NOW, IMAGE)


def test_the_status_shows_the_served_checkpoints_metrics_and_the_last_skipped_candidate_with_an_event_each():
    first = gated_pass({}, [reporting(200, 0.9), reporting(200, 0.9, pod="b")])
    assert first.status["model"]["metrics"] == {"accuracy": 0.9}
    assert "lastSkipped" not in first.status and first.events == []
    promoted = gated_pass({"model": first.status["model"]}, [reporting(300, 0.95), reporting(300, 0.95, pod="b")])
    assert promoted.events == [("Normal", "Promoted", f"serving {MODEL_MOUNT}/digits/step-00000300.pt (accuracy "
                                                      f"0.95) in place of {MODEL_MOUNT}/digits/step-00000200.pt")]
    skipped = gated_pass({"model": promoted.status["model"]}, [reporting(300, 0.95, skipped=(400, 0.4)),
                                                               reporting(300, 0.95, skipped=(400, 0.4), pod="b")])
    assert set(skipped.status) <= OPERATOR_FIELDS, "the operator publishes only the fields it owns"
    assert skipped.status["lastSkipped"] == {"checkpoint": f"{MODEL_MOUNT}/digits/step-00000400.pt",
                                             "reason": "not above", "metric": 0.4}
    assert skipped.events == [("Warning", "PromotionSkipped",
                               f"not serving {MODEL_MOUNT}/digits/step-00000400.pt: not above")]
    again = gated_pass({"model": skipped.status["model"], "lastSkipped": skipped.status["lastSkipped"]},
                       [reporting(300, 0.95, skipped=(400, 0.4))])
    assert again.events == [] and again.status["lastSkipped"] == skipped.status["lastSkipped"], "one Event a skip"
    restarted = gated_pass({"model": skipped.status["model"], "lastSkipped": skipped.status["lastSkipped"]},
                           [reporting(300, 0.95)])
    assert restarted.status["lastSkipped"] == skipped.status["lastSkipped"], "a restarted server forgets; the pool not"


def test_a_swap_across_replicas_is_one_promoted_event_whichever_replica_swaps_first():
    """Mid-swap the pool's checkpoint is the one most ready replicas serve (a tie: the first reported); the Event
    comes with the pass where it changes, and none when the other replica follows."""
    old, new = f"{MODEL_MOUNT}/digits/step-00000200.pt", f"{MODEL_MOUNT}/digits/step-00000300.pt"
    for first in ([reporting(300, 0.95), reporting(200, 0.9, pod="b")],
                  [reporting(200, 0.9, pod="b"), reporting(300, 0.95)]):
        status, reasons = {"model": {"checkpoint": old}}, []
        for reports in (first, [reporting(300, 0.95), reporting(300, 0.95, pod="b")]):
            plan = gated_pass(status, reports)
            reasons += [reason for _, reason, _ in plan.events]
            status = {"model": plan.status["model"]}
        assert reasons == ["Promoted"] and status["model"]["checkpoint"] == new


def test_pinning_a_named_checkpoint_points_the_servers_at_it_and_a_patch_rolls_them_back():
    pinned = pool(model={"fromTrainingJob": {"name": "train", "checkpoint": "step-00000100.pt"}, "inputShape": [64]})
    [created] = [o for o in reconcile_pool(read_resource(pinned), {}, [], [], job(step=300), NOW, IMAGE).apply
                 if o["kind"] == "Deployment"]
    assert created["spec"]["template"]["spec"]["containers"][0]["command"][-2:] == [
        "--checkpoint", f"{MODEL_MOUNT}/digits/step-00000100.pt"]
    steady = copy.deepcopy(pinned)
    steady["status"] = {"observedGeneration": 1}
    children = {"Deployment": {**created, "status": {"readyReplicas": 2, "updatedReplicas": 2}}}
    later = reconcile_pool(read_resource(steady), children, [], [], job(step=400, latest="/x/step-00000400.pt"), NOW,
                           IMAGE)
    assert "Deployment" not in [o["kind"] for o in later.apply], "a newer checkpoint of the job moves nothing"
    rolled_back = copy.deepcopy(steady)
    rolled_back["metadata"]["generation"] = 2
    rolled_back["spec"]["model"]["fromTrainingJob"]["checkpoint"] = "step-00000050.pt"
    [rolled] = [o for o in reconcile_pool(read_resource(rolled_back), children, [], [], job(step=400), NOW, IMAGE).apply
                if o["kind"] == "Deployment"]
    assert rolled["spec"]["template"]["spec"]["containers"][0]["command"][-1] == \
        f"{MODEL_MOUNT}/digits/step-00000050.pt"
    unpinned = copy.deepcopy(rolled_back)
    del unpinned["spec"]["model"]["fromTrainingJob"]["checkpoint"]
    [following] = [o for o in reconcile_pool(read_resource(unpinned), children, [], [], job(step=400), NOW, IMAGE).apply
                   if o["kind"] == "Deployment"]
    assert following["spec"]["template"]["spec"]["containers"][0]["command"][-1] == f"{MODEL_MOUNT}/digits"


def test_the_readmes_rollback_commands_pin_the_example_pool_and_unpin_it():
    """The two `kubectl patch tip digits` lines of the README, applied as kubectl applies them to
    examples/digits-pool.yaml: the first pins step-00000200.pt, the second follows the job again."""
    readme = (ROOT / "docs" / "operator.md").read_text()  # the README's "Gated promotion", in full
    merge = json.loads(re.search(r"kubectl patch tip digits --type merge -p '([^']+)'", readme).group(1))
    remove = json.loads(re.search(r"kubectl patch tip digits --type json -p '([^']+)'", readme).group(1))
    example = yaml.safe_load((ROOT / "examples" / "digits-pool.yaml").read_text())
    pinned = merge_patched(example, merge)
    assert parse(pinned).spec.model.from_training_job.checkpoint == "step-00000200.pt"
    unpinned = json_patch(pinned, remove)
    assert parse(unpinned).spec.model.from_training_job.checkpoint is None
