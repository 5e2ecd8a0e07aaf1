"""The emulated API server evaluates CRDs' CEL rules (`x-kubernetes-validations`, devcluster/cel.py) on every write
that validates against the schema, as a real API server does: create, PUT, patches, the status subresource and the
scale subresource. A write that breaks a rule answers 422 Invalid naming the field and the rule's message, and
changes nothing. Shown on the project's CRDs (crds/, every rule) and on a test CRD with a scale subresource."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from devcluster import Cluster, cel, schema
from devcluster.catalog import kinds_of_crd

ROOT = Path(__file__).resolve().parents[2]
NS = "default"
TANDEM = "/apis/tandem.dev/v1alpha1/namespaces/default"
WIDGETS = "/apis/cel.example.dev/v1/namespaces/default/widgets"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.cel.example.dev"},
    "spec": {"group": "cel.example.dev", "scope": "Namespaced",
             "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
             "versions": [{"name": "v1", "served": True, "storage": True,
                           "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.workers",
                                                                    "statusReplicasPath": ".status.workers"}},
                           "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                               "spec": {"type": "object", "required": ["workers"], "properties": {
                                   "workers": {"type": "integer", "minimum": 0, "x-kubernetes-validations": [
                                       {"rule": "self <= 64", "message": "at most 64 workers"}]},
                                   "ranksPerPod": {"type": "integer", "minimum": 1},
                                   "mode": {"type": "string", "default": "shared", "x-kubernetes-validations": [
                                       {"rule": "self == oldSelf", "message": "mode is immutable"}]},
                                   "secret": {"type": "string"},
                                   "ratio": {"type": "number"},
                                   "tags": {"type": "array", "items": {"type": "string", "x-kubernetes-validations": [
                                       {"rule": "self.size() <= 5"}]}},
                                   "limits": {"type": "object", "additionalProperties": {
                                       "type": "integer", "x-kubernetes-validations": [
                                           {"rule": "self >= 0",
                                            "messageExpression": "'limit ' + string(self) + ' is negative'"}]}},
                                   "max-items": {"type": "integer"},
                               }, "x-kubernetes-validations": [
                                   {"rule": "!has(self.ranksPerPod) || self.workers % self.ranksPerPod == 0",
                                    "message": "workers must be a multiple of ranksPerPod"},
                                   {"rule": "!has(self.secret) || self.mode == 'private'", "fieldPath": ".secret",
                                    "reason": "FieldValueForbidden", "message": "a secret needs mode private"},
                                   {"rule": "!has(self.ratio) || self.ratio <= 1.5 && self.ratio > 0",
                                    "message": "ratio is in (0, 1.5]"},
                                   {"rule": "!has(self.max__dash__items) || self.max__dash__items > 0",
                                    "message": "max-items is positive"},
                               ]},
                               "status": {"type": "object", "properties": {
                                   "workers": {"type": "integer"}, "ready": {"type": "integer"}},
                                   "x-kubernetes-validations": [
                                       {"rule": "!has(self.ready) || self.ready <= self.workers",
                                        "message": "ready cannot exceed workers"}]},
                           }}}}]}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cel"), kubelet=False, deployments=False) as running:
        status, body = running.request("POST", CRDS, WIDGET_CRD)
        assert status == 201, body
        yield running
    assert not running.emulator.bugs, running.emulator.bugs


def ptj(name: str, **spec) -> dict:
    trainer = {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data",
               **spec.pop("trainer", {})}
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": name},
            "spec": {"workers": 2, "trainer": trainer, **spec}}


def pool(name: str, **spec) -> dict:
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool", "metadata": {"name": name},
            "spec": {"replicas": 1, "model": {"fromTrainingJob": {"name": "digits"}, "inputShape": [64]}, **spec}}


def widget(name: str, **spec) -> dict:
    return {"apiVersion": "cel.example.dev/v1", "kind": "Widget", "metadata": {"name": name},
            "spec": {"workers": 4, **spec}}


SPARSITY = {"trainingMode": "sharedGradients"}
PTJ_422 = 'ParallelTrainingJob.tandem.dev "{}" is invalid: '
WIDGET_422 = 'Widget.cel.example.dev "{}" is invalid: '

# (collection, object, the 422's problem or None when the create passes)
CREATES = [
    ("paralleltrainingjobs", ptj("custom-without-command", trainingMode="custom"),
     'spec: Invalid value: "object": trainingMode custom needs custom.command (the command every rank runs)'),
    ("paralleltrainingjobs", ptj("custom-with-command", trainingMode="custom", custom={"command": ["true"]}), None),
    ("paralleltrainingjobs", ptj("gpu-without-gpus", trainer={"requireGPU": True}),
     'spec: Invalid value: "object": trainer.requireGPU needs gpusPerWorker >= 1: a rank given no GPU trains on CPU'),
    ("paralleltrainingjobs", ptj("gpu-with-gpus", gpusPerWorker=1, trainer={"requireGPU": True}), None),
    ("paralleltrainingjobs", ptj("no-gpu-required", trainer={"requireGPU": False}), None),
    ("paralleltrainingjobs", ptj("shared-fp16", **SPARSITY, trainer={"mixedPrecision": "fp16"}),
     'spec: Invalid value: "object": sharedGradients encodes gradients against a threshold'),
    ("paralleltrainingjobs", ptj("shared-bf16", **SPARSITY, trainer={"mixedPrecision": "bf16"}), None),
    # a rule deep in the spec, with self at its own node; `max: 1` is a number (a double), as a server types it
    ("paralleltrainingjobs", ptj("sparsity-inverted", **SPARSITY, sharedGradients={"targetSparsity": {
        "min": 0.01, "max": 0.001}}),
     'spec.sharedGradients.targetSparsity: Invalid value: "object": targetSparsity.min must not exceed '
     'targetSparsity.max'),
    ("paralleltrainingjobs", ptj("sparsity-band", **SPARSITY, sharedGradients={"targetSparsity": {
        "min": 0.001, "max": 1}}), None),
    # spec.elastic (issue 38): the rules read minWorkers and maxWorkers through has(), so that an elastic with
    # neither (its defaults filled in or not) passes
    ("paralleltrainingjobs", ptj("elastic-defaults", elastic={}), None),
    ("paralleltrainingjobs", ptj("elastic-range", workers=4, elastic={
        "minWorkers": 2, "maxWorkers": 8, "batch": "perRank", "lrScaling": "sqrt"}), None),
    ("paralleltrainingjobs", ptj("elastic-fixed-size", workers=4, elastic={"minWorkers": 4, "maxWorkers": 4}), None),
    ("paralleltrainingjobs", ptj("elastic-min-above-workers", elastic={"minWorkers": 3}),
     'spec: Invalid value: "object": workers must be at least elastic.minWorkers: kubectl scale may ask for any '
     'size in [minWorkers, maxWorkers]; raise workers (or the replicas of kubectl scale) or lower '
     'elastic.minWorkers'),
    ("paralleltrainingjobs", ptj("elastic-above-max", workers=4, elastic={"maxWorkers": 3}),
     'spec: Invalid value: "object": workers must not exceed elastic.maxWorkers: kubectl scale may ask for any '
     'size in [minWorkers, maxWorkers]; lower workers (or the replicas of kubectl scale) or raise '
     'elastic.maxWorkers'),
    ("paralleltrainingjobs", ptj("elastic-min-above-max", workers=4, elastic={"minWorkers": 5, "maxWorkers": 3}),
     'spec.elastic: Invalid value: "object": elastic.minWorkers must not exceed elastic.maxWorkers: lower '
     'minWorkers or raise maxWorkers'),
    ("paralleltrainingjobs", ptj("elastic-custom", trainingMode="custom", custom={"command": ["true"]}, elastic={}),
     'spec: Invalid value: "object": elastic needs Tandem\'s trainer, which regroups the ranks; a trainingMode '
     'custom command cannot: remove elastic or choose another trainingMode'),
    ("paralleltrainingjobs", ptj("elastic-ranks-per-pod", workers=4, ranksPerPod=2, elastic={}),
     'spec: Invalid value: "object": elastic needs ranksPerPod 1 for now (every rank its own pod, so that a lost '
     'rank is replaced alone): remove elastic or set ranksPerPod 1'),
    ("paralleltrainingjobs", ptj("elastic-shared-gradients", trainingMode="sharedGradients", elastic={}), None),
    ("paralleltrainingjobs", ptj("rigid-ranks-per-pod", workers=4, ranksPerPod=2), None),
    ("inferencepools", pool("autoscaling-inverted", autoscaling={"minReplicas": 4, "maxReplicas": 2}),
     'spec.autoscaling: Invalid value: "object": minReplicas must not exceed maxReplicas'),
    ("inferencepools", pool("autoscaling-band", autoscaling={"minReplicas": 1, "maxReplicas": 2}), None),
    ("widgets", widget("ranks-mismatch", workers=5, ranksPerPod=2),
     'spec: Invalid value: "object": workers must be a multiple of ranksPerPod'),
    ("widgets", widget("ranks-match", workers=6, ranksPerPod=3), None),
    ("widgets", widget("ranks-absent", workers=5), None),
    ("widgets", widget("too-many", workers=65), 'spec.workers: Invalid value: "integer": at most 64 workers'),
    ("widgets", widget("secret-shared", secret="s"), "spec.secret: Forbidden: a secret needs mode private"),
    ("widgets", widget("secret-private", secret="s", mode="private"), None),
    ("widgets", widget("ratio-int", ratio=1), None),  # a number written as an int compares with doubles
    ("widgets", widget("ratio-big", ratio=2), 'spec: Invalid value: "object": ratio is in (0, 1.5]'),
    ("widgets", widget("long-tag", tags=["ok", "toolong"]),
     'spec.tags[1]: Invalid value: "string": failed rule: self.size() <= 5'),
    ("widgets", widget("negative-limit", limits={"cpu": 1, "gpu": -1}),
     'spec.limits[gpu]: Invalid value: "integer": limit -1 is negative'),
    ("widgets", widget("dashed-name", **{"max-items": 0}), 'spec: Invalid value: "object": max-items is positive'),
    # a type error blocks the rules, as on a server: they are reported as not checked
    ("widgets", widget("wrong-type", workers="many", ranksPerPod=2),
     '<nil>: Invalid value: "null": some validation rules were not checked because the object was invalid'),
]


@pytest.mark.parametrize(("collection", "document", "problem"), CREATES,
                         ids=[c[1]["metadata"]["name"] for c in CREATES])
def test_a_create_that_breaks_a_rule_is_refused_with_its_message(cluster, collection, document, problem):
    path = WIDGETS if collection == "widgets" else f"{TANDEM}/{collection}"
    status, body = cluster.request("POST", path, document)
    name = document["metadata"]["name"]
    if problem is None:
        assert status == 201, body
        return
    kind = "Widget.cel.example.dev" if collection == "widgets" else f"{document['kind']}.tandem.dev"
    assert status == 422 and body["reason"] == "Invalid", body
    assert body["message"].startswith(f'{kind} "{name}" is invalid: ') and problem in body["message"], body
    assert any(problem in f'{cause["field"]}: {cause["message"]}' for cause in body["details"]["causes"])
    assert cluster.get(collection, NS, name) is None


def _stored(cluster: Cluster, name: str) -> dict:
    return copy.deepcopy(cluster.get("widgets", NS, name))


# (name, how it is written, the body, the 422's problem)
WRITES = [
    ("merge-patch", "PATCH", MERGE, {"spec": {"workers": 5}},
     'spec: Invalid value: "object": workers must be a multiple of ranksPerPod'),
    ("json-patch", "PATCH", JSON_PATCH, [{"op": "replace", "path": "/spec/ranksPerPod", "value": 3}],
     'spec: Invalid value: "object": workers must be a multiple of ranksPerPod'),
    ("put", "PUT", None, {"spec": {"workers": 4, "ranksPerPod": 2, "ratio": -1}},
     'spec: Invalid value: "object": ratio is in (0, 1.5]'),
    ("transition", "PATCH", MERGE, {"spec": {"mode": "private"}},
     'spec.mode: Invalid value: "string": mode is immutable'),
    ("status", "PATCH", MERGE, {"status": {"workers": 4, "ready": 5}},
     'status: Invalid value: "object": ready cannot exceed workers'),
    ("scale-patch", "PATCH", MERGE, {"spec": {"replicas": 5}},
     'spec: Invalid value: "object": workers must be a multiple of ranksPerPod'),
    ("scale-put", "PUT", None, {"spec": {"replicas": 66}},
     'spec.workers: Invalid value: "integer": at most 64 workers'),
]


@pytest.mark.parametrize(("case", "method", "content_type", "body", "problem"), WRITES, ids=[w[0] for w in WRITES])
def test_an_update_that_breaks_a_rule_is_refused_and_changes_nothing(cluster, case, method, content_type, body,
                                                                     problem):
    name = f"w-{case}"
    status, created = cluster.request("POST", WIDGETS, widget(name, workers=4, ranksPerPod=2))
    assert status == 201, created
    path = f"{WIDGETS}/{name}" + {"status": "/status", "scale-patch": "/scale", "scale-put": "/scale"}.get(case, "")
    if method == "PUT":
        current = cluster.request("GET", path)[1]
        body = {**current, **body}
    before = _stored(cluster, name)
    status, answer = cluster.request(method, path, body, content_type or "application/json")
    assert status == 422 and answer["reason"] == "Invalid", answer
    assert answer["message"] == WIDGET_422.format(name) + problem, answer
    assert _stored(cluster, name) == before


# (name, the path's suffix, the content type, the body): writes that keep every rule pass
VALID_WRITES = [
    ("merge-patch", "", MERGE, {"spec": {"workers": 8}}),
    ("transition-same", "", MERGE, {"spec": {"mode": "shared", "workers": 2}}),
    ("status", "/status", MERGE, {"status": {"workers": 4, "ready": 4}}),
    ("scale", "/scale", MERGE, {"spec": {"replicas": 6}}),
]


@pytest.mark.parametrize(("case", "suffix", "content_type", "body"), VALID_WRITES, ids=[w[0] for w in VALID_WRITES])
def test_an_update_that_keeps_the_rules_passes(cluster, case, suffix, content_type, body):
    name = f"ok-{case}"
    assert cluster.request("POST", WIDGETS, widget(name, workers=4, ranksPerPod=2))[0] == 201
    status, answer = cluster.request("PATCH", f"{WIDGETS}/{name}{suffix}", body, content_type)
    assert status == 200, answer
    stored = cluster.get("widgets", NS, name)
    if case == "scale":
        assert stored["spec"]["workers"] == 6 and stored["metadata"]["generation"] == 2
    elif case == "status":
        assert stored["status"] == body["status"]
    else:
        assert {k: stored["spec"][k] for k in body["spec"]} == body["spec"]


# (replicas asked of a job of 4 ranks with elastic minWorkers 2, maxWorkers 6; the 422's problem or None)
ELASTIC_SCALES = [
    (2, None),
    (6, None),
    (1, 'spec: Invalid value: "object": workers must be at least elastic.minWorkers: kubectl scale may ask for any '
        'size in [minWorkers, maxWorkers]; raise workers (or the replicas of kubectl scale) or lower '
        'elastic.minWorkers'),
    (7, 'spec: Invalid value: "object": workers must not exceed elastic.maxWorkers: kubectl scale may ask for any '
        'size in [minWorkers, maxWorkers]; lower workers (or the replicas of kubectl scale) or raise '
        'elastic.maxWorkers'),
]


@pytest.mark.parametrize(("replicas", "problem"), ELASTIC_SCALES, ids=[f"to-{s[0]}" for s in ELASTIC_SCALES])
def test_kubectl_scale_of_an_elastic_job_stays_in_its_range(cluster, replicas, problem):
    """The scale subresource writes spec.workers, so the spec's rules hold it in [minWorkers, maxWorkers]."""
    name = f"elastic-scale-to-{replicas}"
    document = ptj(name, workers=4, elastic={"minWorkers": 2, "maxWorkers": 6})
    assert cluster.request("POST", f"{TANDEM}/paralleltrainingjobs", document)[0] == 201
    status, answer = cluster.request("PATCH", f"{TANDEM}/paralleltrainingjobs/{name}/scale",
                                     {"spec": {"replicas": replicas}}, MERGE)
    workers = cluster.get("paralleltrainingjobs", NS, name)["spec"]["workers"]
    if problem is None:
        assert status == 200 and workers == replicas, answer
        return
    assert status == 422 and answer["message"] == PTJ_422.format(name) + problem, answer
    assert workers == 4


def _elastic_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "elastic" in line]


@pytest.mark.parametrize("elastic", [{}, {"minWorkers": 2}, {"minWorkers": 3}, {"maxWorkers": 1},
                                     {"minWorkers": 3, "maxWorkers": 1}])
def test_the_elastic_rules_hold_whether_or_not_the_defaults_are_filled_in(elastic):
    """A server fills in the defaults before it evaluates the rules; the elastic rules give the same answer on the
    object as written, where minWorkers (default 1) may be absent."""
    crd = yaml.safe_load((ROOT / "crds" / "tandem.dev_paralleltrainingjobs.yaml").read_text())
    root = dict(kinds_of_crd(crd)[0].schema)
    written = ptj("elastic", elastic=elastic)
    defaulted = schema.prune_and_default(written, root, root=True)
    assert _elastic_lines(cel.violations(written, root)) == _elastic_lines(cel.violations(defaulted, root))


def test_an_object_stored_before_a_rule_is_ratcheted_until_its_value_changes(cluster):
    """Under a CRD without its rules an object that breaks one is stored; with the rules back, writes that leave the
    spec as it is pass (ratcheting, as on servers since 1.30), and a change to the spec meets the rule."""
    with cluster.crd_without_rules("widgets.cel.example.dev"):
        assert cluster.request("POST", WIDGETS, widget("legacy", workers=5, ranksPerPod=2))[0] == 201
    path = f"{WIDGETS}/legacy"
    status, answer = cluster.request("PATCH", path, {"metadata": {"labels": {"seen": "yes"}}}, MERGE)
    assert status == 200, answer
    assert cluster.request("PATCH", path + "/status", {"status": {"workers": 5}}, MERGE)[0] == 200
    status, answer = cluster.request("PATCH", path, {"spec": {"workers": 7}}, MERGE)
    assert status == 422 and "workers must be a multiple of ranksPerPod" in answer["message"], answer


BAD_RULES = [
    ("unparsable", {"rule": "self.workers >"}),
    ("empty", {"rule": " "}),
    ("bad-message-expression", {"rule": "true", "messageExpression": "'a' +"}),
]


@pytest.mark.parametrize(("case", "rule"), BAD_RULES, ids=[b[0] for b in BAD_RULES])
def test_a_crd_whose_rule_does_not_compile_is_refused(cluster, case, rule):
    crd = copy.deepcopy(WIDGET_CRD)
    crd["metadata"]["name"] = f"{case}s.cel.example.dev"
    crd["spec"].update(group="cel.example.dev", names={"plural": f"{case}s", "kind": "Broken" + str(len(case))})
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"] = [rule]
    status, body = cluster.request("POST", CRDS, crd)
    assert status == 422, body
    field = "messageExpression" if "messageExpression" in rule else "rule"
    assert (f"spec.versions[0].schema.openAPIV3Schema.properties[spec].x-kubernetes-validations[0].{field}: "
            f"Invalid value: ") in body["message"] and "compilation failed" in body["message"], body
    assert cluster.get("customresourcedefinitions", None, crd["metadata"]["name"]) is None


def test_a_rule_that_fails_to_evaluate_is_a_failed_validation_not_a_crash():
    """cel-python does not type-check: what a server's compiler would refuse (here an unknown function) is met when
    a write evaluates the rule, and answered as a server answers an evaluation error."""
    node = {"type": "object", "properties": {"name": {"type": "string"}},
            "x-kubernetes-validations": [{"rule": "self.name.lowerAscii() == self.name", "message": "lower case"},
                                         {"rule": "self.missing == 1"}]}
    root = {"type": "object", "properties": {"spec": node}}
    lines = cel.violations({"spec": {"name": "A"}}, root)
    assert len(lines) == 2 and all(line.startswith('spec: Invalid value: "object": ') for line in lines), lines
    assert lines[0].endswith("evaluating rule: lower case") and "lowerAscii" in lines[0], lines
    assert lines[1].endswith("evaluating rule: self.missing == 1"), lines


def _rules(schema_node: dict, path: str = "") -> list[tuple[str, str]]:
    found = [(path, rule["rule"]) for rule in schema_node.get("x-kubernetes-validations") or []]
    for key, sub in (schema_node.get("properties") or {}).items():
        found += _rules(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema_node.get(key), dict):
            found += _rules(schema_node[key], f"{path}[*]")
    return found


def test_every_rule_of_the_projects_crds_compiles_and_the_examples_keep_them():
    """crds/ (generated by `tandem crds`): every rule compiles, and every example manifest passes every rule with
    no evaluation error (the rules read only fields that are defaulted or guarded by has())."""
    kinds = {}
    count = 0
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        assert cel.crd_problems(crd) == [], path
        for kind in kinds_of_crd(crd):
            kinds[kind.kind] = kind
            count += len(_rules(dict(kind.schema)))
    assert count >= 5  # the rules shown in CREATES above
    examples = 0
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            kind = kinds.get((document or {}).get("kind"))
            if kind is None:
                continue
            obj = schema.prune_and_default(document, kind.schema, root=True)
            assert schema.problems(obj, kind.schema) == [], path
            examples += 1
    assert examples >= 2
