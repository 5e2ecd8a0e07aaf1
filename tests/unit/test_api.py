"""The API models, the generated CRDs and manifest validation (issue #2)."""

from __future__ import annotations

from copy import deepcopy

import kubernetes_validate
import pytest
import yaml
from jobs import ROOT
from openapi_schema_validator import OAS30Validator

import tandem
from tandem.api import InferencePool, ParallelTrainingJob
from tandem.cli import main
from tandem.crd import RESOURCES, crd, crd_files
from tandem.manifest import ManifestError, load_file, parse

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_generated_crds_equal_the_committed_ones():
    generated = crd_files()
    committed = {path.name: path.read_text() for path in (ROOT / "crds").glob("*.yaml")}
    assert committed == generated, "crds/ is stale: run `make crds` (tandem crds --out crds)"


@pytest.mark.parametrize("path", sorted((ROOT / "crds").glob("*.yaml")), ids=lambda p: p.name)
def test_crds_pass_kubernetes_validate_strict(path):
    document = yaml.safe_load(path.read_text())
    kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)


def _walk(node, path="schema"):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("kind", list(RESOURCES))
def test_crd_schemas_are_structural(kind):
    """apiextensions.k8s.io/v1 rules: every node typed, no refs or type unions, defaults valid where they sit."""
    schema = crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert not {"$ref", "anyOf", "allOf", "title", "$defs", "const"} & node.keys(), path
        typed = "type" in node or node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"
        )
        assert typed, f"{path} has no type"
        if "default" in node:
            assert not list(OAS30Validator(node).iter_errors(node["default"])), f"{path}: bad default"
        for branch in node.get("oneOf", []):
            assert set(branch) == {"required"}, f"{path}: oneOf may only constrain, not type"


def test_crd_names_resolve_for_kubectl():
    job = crd("ParallelTrainingJob")["spec"]["names"]
    assert job["plural"] == "paralleltrainingjobs"
    assert {"ptj", "trainingjobs"} <= set(job["shortNames"])
    pool = crd("InferencePool")["spec"]["names"]
    assert pool["plural"] == "inferencepools"
    # Gateway API's inference extension has a kind InferencePool too: our short names must be our own.
    assert pool["shortNames"] and not {"inferencepool", "pool", "ip"} & set(pool["shortNames"])


def test_subresources_status_and_scale():
    for kind, replicas in (("ParallelTrainingJob", ".spec.workers"), ("InferencePool", ".spec.replicas")):
        subresources = crd(kind)["spec"]["versions"][0]["subresources"]
        assert subresources["status"] == {}
        assert subresources["scale"]["specReplicasPath"] == replicas


def _jsonpath(obj, path):
    for part in path.lstrip(".").split("."):
        obj = obj[part]
    return obj


def _sample_job() -> dict:
    job = yaml.safe_load((ROOT / "examples/digits-train.yaml").read_text())
    job["metadata"]["creationTimestamp"] = "2026-11-29T10:00:00Z"
    job["status"] = ParallelTrainingJob.model_validate({
        **job,
        "status": {
            "phase": "Running",
            "workers": {"ready": 1, "total": 2},
            "progress": {"epoch": 3, "step": 120, "totalSteps": 450, "loss": 0.3108642, "samplesPerSecond": 1840.7,
                         "etaSeconds": 755.2},
            "restarts": 1,
            "recoveries": {"regroups": 2, "restarts": 1},
            "lastRecovery": {"kind": "regroup", "lost": [1], "added": [], "workers": 1, "stoppedAtStep": 118,
                             "resumedAtStep": 118, "seconds": 3.5, "time": "2026-11-29T10:06:00Z"},
            "checkpoint": {"latest": "/ckpt/step-00000100.pt", "step": 100, "time": "2026-11-29T10:05:00Z"},
            "queue": {"name": "team-a", "workload": "digits-train", "admitted": True, "reason": "Admitted"},
            "lent": {"workers": 1, "to": ["digits"], "since": "2026-11-29T10:07:00Z", "pools": [
                {"name": "digits", "workers": 1, "baseReplicas": 1, "workersPerReplica": 1.0}]},
        },
    }).status.to_dict()
    return job


def _sample_pool() -> dict:
    pool = yaml.safe_load((ROOT / "examples/digits-pool.yaml").read_text())
    pool["metadata"]["creationTimestamp"] = "2026-11-29T10:00:00Z"
    pool["status"] = InferencePool.model_validate({
        **pool,
        "status": {
            "phase": "Ready", "replicas": 2, "readyReplicas": 1, "endpoint": "http://digits.default.svc:8000",
            "model": {"source": "fromTrainingJob/digits-train", "checkpoint": "/ckpt/step-00000100.pt",
                      "metrics": {"accuracy": 0.9722222}, "gateMetric": "accuracy=0.9722"},
            "borrowed": {"workers": 1, "from": ["digits-train"], "since": "2026-11-29T10:07:00Z"},
        },
    }).status.to_dict()
    return pool


def test_printer_columns_resolve_against_a_sample_status():
    job = _sample_job()
    columns = {c["name"]: _jsonpath(job, c["jsonPath"]) for c in RESOURCES["ParallelTrainingJob"].printer_columns}
    assert columns == {
        "Phase": "Running", "Ready": "1/2", "Step": "120/450", "Loss": "0.3109", "Samples/s": "1841", "ETA": "12m",
        "Restarts": 1, "Checkpoint": "step-00000100.pt", "Queue": "team-a", "Lent": 1,
        "Checkpoint Path": "/ckpt/step-00000100.pt", "Age": "2026-11-29T10:00:00Z",
    }
    pool = _sample_pool()
    columns = {c["name"]: _jsonpath(pool, c["jsonPath"]) for c in RESOURCES["InferencePool"].printer_columns}
    assert columns == {
        "Phase": "Ready", "Ready": "1/2", "Mode": "batched", "Model": "fromTrainingJob/digits-train",
        "Checkpoint": "step-00000100.pt", "Endpoint": "http://digits.default.svc:8000",
        "Checkpoint Path": "/ckpt/step-00000100.pt", "Metric": "accuracy=0.9722", "Borrowed": 1,
        "Age": "2026-11-29T10:00:00Z",
    }


@pytest.mark.parametrize(("kind", "sample"), [("ParallelTrainingJob", _sample_job), ("InferencePool", _sample_pool)])
def test_sample_status_validates_against_the_crd_schema(kind, sample):
    schema = crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    document = sample()
    assert not [e.message for e in OAS30Validator(schema).iter_errors(document)]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates(path):
    assert load_file(path)
    assert main(["validate", str(path)]) == 0


def test_examples_cover_every_mode_and_the_pool():
    resources = [r for path in EXAMPLES for r in load_file(path)]
    modes = {r.spec.training_mode for r in resources if isinstance(r, ParallelTrainingJob)}
    assert {"allReduce", "sharedGradients", "averaging"} <= modes
    assert any(isinstance(r, InferencePool) for r in resources)
    train = load_file(ROOT / "examples/digits-train.yaml")[0]
    assert train.spec.workers == 2 and train.spec.training_mode == "allReduce" and train.spec.gpus_per_worker == 0


def test_defaults_follow_dl4j():
    job = parse({"apiVersion": "tandem.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": "j"},
                 "spec": {"trainer": {"model": "m:f", "data": "d:f"}}})
    assert job.spec.averaging.frequency == 1 and job.spec.averaging.average_optimizer_state is True
    shared = job.spec.shared_gradients
    assert shared.initial_threshold == 1e-3
    assert (shared.residual_clip.factor, shared.residual_clip.every) == (5.0, 5)
    pool = parse({"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool", "metadata": {"name": "p"},
                  "spec": {"model": {"callable": "m:f"}}})
    assert (pool.spec.batch_limit, pool.spec.queue_limit, pool.spec.inference_mode) == (32, 64, "batched")


def _train(**spec):
    trainer = {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data"}
    base = {"workers": 2, "trainer": trainer}
    base.update(spec)
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": "t"}, "spec": base}


def _pool(**spec):
    base = {"model": {"callable": "tandem.examples.digits:mlp"}}
    base.update(spec)
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool", "metadata": {"name": "p"}, "spec": base}


def _without_model():
    doc = _train()
    del doc["spec"]["trainer"]["model"]
    return doc


def _with(doc, path, value):
    doc = deepcopy(doc)
    *parents, last = path.split(".")
    node = doc
    for part in parents:
        node = node[part]
    node[last] = value
    return doc


INVALID = [
    ("wrong type", _train(workers="two"), "spec.workers", "integer"),
    ("workers below 1", _train(workers=0), "spec.workers", "greater than or equal to 1"),
    ("unknown mode", _train(trainingMode="ring"), "spec.trainingMode", "'allReduce'"),
    ("missing model", _without_model(), "spec.trainer.model", "required"),
    ("negative batchLimit", _pool(batchLimit=-1), "spec.batchLimit", "greater than or equal to 1"),
    ("unknown field", _train(worker=2), "spec.worker", "unknown field; did you mean 'workers'? allowed here: "),
    ("unknown field, nothing close", _train(zzz=2), "spec.zzz", "unknown field; allowed here: "),
    ("unknown nested field", _with(_train(), "spec.trainer.lr", 0.1), "spec.trainer.lr", "allowed here: "),
    ("bad model reference", _with(_train(), "spec.trainer.model", "no-colon"), "spec.trainer.model", "pattern"),
    ("bad data reference", _with(_train(), "spec.trainer.data", "data.csv"), "spec.trainer.data", ".npz"),
    ("unknown optimizer", _train(trainer={"model": "m:f", "data": "d:f", "optimizer": {"name": "lamb"}}),
     "spec.trainer.optimizer.name", "'sgd'"),
    ("sparsity band inverted", _train(sharedGradients={"targetSparsity": {"min": 0.1, "max": 0.01}}),
     "spec.sharedGradients.targetSparsity", "must not exceed"),
    ("custom without command", _train(trainingMode="custom"), "spec", "custom.command"),
    ("fp16 with sharedGradients", _train(trainingMode="sharedGradients", trainer={
        "model": "m:f", "data": "d:f", "mixedPrecision": "fp16"}), "spec", "use trainer.mixedPrecision bf16"),
    ("requireGPU without GPUs", _train(trainer={"model": "m:f", "data": "d:f", "requireGPU": True}), "spec",
     "trainer.requireGPU needs gpusPerWorker >= 1"),
    ("bad quantity", _train(resources={"limits": {"cpu": "lots"}}), "spec.resources.limits", "quantity"),
    ("two model sources", _pool(model={"callable": "m:f", "checkpoint": "/c.pt"}), "spec.model", "exactly one"),
    ("no model source", _pool(model={}), "spec.model", "exactly one"),
    ("autoscaling inverted", _pool(autoscaling={"minReplicas": 3, "maxReplicas": 1}), "spec.autoscaling", "exceed"),
    ("port out of range", _pool(port=70000), "spec.port", "65535"),
    ("unknown mode (pool)", _pool(inferenceMode="parallel"), "spec.inferenceMode", "'batched'"),
    ("bad name", _with(_train(), "metadata.name", "Digits_Train"), "metadata.name", "pattern"),
    ("wrong kind", _with(_train(), "kind", "PyTorchJob"), "kind", "ParallelTrainingJob"),
    ("wrong version", _with(_train(), "apiVersion", "kubeflow.org/v1"), "apiVersion", "tandem.dev/v1alpha1"),
]


@pytest.mark.parametrize(("case", "document", "field", "hint"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_manifests_are_rejected_naming_the_field(case, document, field, hint):
    with pytest.raises(ManifestError) as caught:
        parse(document)
    matching = [p for p in caught.value.problems if p.startswith(field + ":")]
    assert matching, f"no problem names {field}: {caught.value.problems}"
    assert any(hint in p for p in matching), matching


# (case, spec.elastic and the spec fields beside it, a substring of the refusal or None when the spec is valid)
ELASTIC = [
    ("empty: every default", {"elastic": {}}, None),
    ("shrinks to 2 of 4", {"workers": 4, "elastic": {"minWorkers": 2}}, None),
    ("grows to 8", {"workers": 4, "elastic": {"minWorkers": 2, "maxWorkers": 8}}, None),
    ("a fixed size", {"workers": 4, "elastic": {"minWorkers": 4, "maxWorkers": 4}}, None),
    ("perRank, sqrt", {"elastic": {"batch": "perRank", "lrScaling": "sqrt"}}, None),
    ("restart recovery", {"elastic": {"recovery": "restart", "regroupDeadlineSeconds": 5}}, None),
    ("averaging", {"trainingMode": "averaging", "elastic": {}}, None),
    ("sharedGradients", {"trainingMode": "sharedGradients", "elastic": {}}, None),
    ("minWorkers above workers", {"workers": 2, "elastic": {"minWorkers": 3}},
     "workers (2) must be at least elastic.minWorkers (3): kubectl scale may ask for any size in "
     "[minWorkers, maxWorkers]; raise workers"),
    ("workers above maxWorkers", {"workers": 4, "elastic": {"maxWorkers": 3}},
     "workers (4) must not exceed elastic.maxWorkers (3): kubectl scale may ask for any size in "
     "[minWorkers, maxWorkers]; lower workers"),
    ("minWorkers above maxWorkers", {"workers": 4, "elastic": {"minWorkers": 5, "maxWorkers": 3}},
     "elastic.minWorkers (5) must not exceed elastic.maxWorkers (3): lower minWorkers or raise maxWorkers"),
    ("custom", {"trainingMode": "custom", "custom": {"command": ["true"]}, "elastic": {}},
     "elastic needs Tandem's trainer, which regroups the ranks; a trainingMode custom command cannot"),
    ("ranksPerPod 2", {"workers": 4, "ranksPerPod": 2, "elastic": {}},
     "elastic needs ranksPerPod 1 for now, not 2 (every rank its own pod, so that a lost rank is replaced alone)"),
    ("minWorkers 0", {"elastic": {"minWorkers": 0}}, "greater than or equal to 1"),
    ("maxWorkers 0", {"elastic": {"maxWorkers": 0}}, "greater than or equal to 1"),
    ("regroupDeadlineSeconds 0", {"elastic": {"regroupDeadlineSeconds": 0}}, "greater than or equal to 1"),
    ("unknown recovery", {"elastic": {"recovery": "resume"}}, "'regroup'"),
    ("unknown batch", {"elastic": {"batch": "local"}}, "'perRank'"),
    ("unknown lrScaling", {"elastic": {"lrScaling": "cubic"}}, "'sqrt'"),
    ("unknown field", {"elastic": {"minimumWorkers": 1}}, "spec.elastic.minimumWorkers: unknown field; did you mean"),
]


@pytest.mark.parametrize(("case", "spec", "problem"), ELASTIC, ids=[c[0] for c in ELASTIC])
def test_elastic_specs_are_validated(case, spec, problem):
    document = _train(**spec)
    if problem is None:
        assert parse(document).spec.elastic is not None
        return
    with pytest.raises(ManifestError) as caught:
        parse(document)
    assert any(problem in p for p in caught.value.problems), caught.value.problems


def test_elastic_defaults_and_which_jobs_regroup():
    rigid = parse(_train(workers=4)).spec
    assert rigid.elastic is None and not rigid.regroups
    spec = parse(_train(workers=4, elastic={})).spec
    assert spec.elastic.to_dict() == {"minWorkers": 1, "recovery": "regroup", "batch": "global",
                                      "lrScaling": "linear", "regroupDeadlineSeconds": 60}
    assert spec.regroups
    assert not parse(_train(workers=4, elastic={"recovery": "restart"})).spec.regroups


def test_a_status_counts_no_recovery_until_one_happens():
    status = ParallelTrainingJob.model_validate({**_train(), "status": {}}).status
    assert status.to_dict()["recoveries"] == {"regroups": 0, "restarts": 0}
    assert "lastRecovery" not in status.to_dict()


def test_validate_cli_reports_every_problem_and_fails(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all([_train(workers=0), _pool(batchLimit=0)]))
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "document 1: spec.workers" in err and "document 2: spec.batchLimit" in err


@pytest.mark.parametrize("text", ["a: [unclosed", "", "- just\n- a list\n"])
def test_malformed_yaml_is_a_clear_error(tmp_path, text):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ManifestError) as caught:
        load_file(bad)
    assert str(bad) in str(caught.value)


def test_a_yaml_error_names_the_file_and_line_not_a_string(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("spec:\n  workers: [2\n")
    with pytest.raises(ManifestError) as caught:
        load_file(bad)
    assert f'in "{bad}", line 2' in str(caught.value) and "<unicode string>" not in str(caught.value)


def test_crds_command_prints_both_crds(capsys):
    assert main(["crds"]) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {d["spec"]["names"]["kind"] for d in documents} == {"ParallelTrainingJob", "InferencePool"}


def test_crds_command_writes_one_file_per_crd_with_out(tmp_path, capsys):
    assert main(["crds", "--out", str(tmp_path / "crds")]) == 0
    written = {path.name: path.read_text() for path in (tmp_path / "crds").iterdir()}
    assert written == crd_files()
    assert capsys.readouterr().out.count("wrote ") == len(written) == 2


def test_the_readme_example_manifest_validates():
    readme = "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    blocks = [b.split("```", 1)[0] for b in readme.split("```yaml\n")[1:]]
    documents = [document for block in blocks for document in yaml.safe_load_all(block)]
    manifests = [d for d in documents if isinstance(d, dict) and str(d.get("apiVersion", "")).startswith("tandem.dev/")]
    assert manifests, "the README shows an annotated manifest"
    for manifest in manifests:
        assert parse(manifest)


def test_version_is_printed_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"tandem {tandem.__version__}\n"
