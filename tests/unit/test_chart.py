"""The Helm chart (charts/tandem) and the images (Dockerfile), checked offline.

Helm runs in process through helm-python-sdk: its wheel bundles Helm's Go library (libhelm_c.so, Helm v4), so
lint and template need neither a helm binary nor a network. Every rendered object is validated by
kubernetes-validate (the official schemas, strict) except the Prometheus Operator's ServiceMonitor and PodMonitor,
which have no official schema (their selectors are checked against what they must select instead), and kopf's
peering objects, validated against the chart's own CRD for them.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from openapi_schema_validator import OAS30Validator

from tandem.api.training import TrainingPhase
from tandem.cli import build_parser
from tandem.manifest import load_one
from tandem.operator import main as operator_main
from tandem.operator import pod_template, pool_objects, training_objects

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tandem"
NAMESPACE = "tandem-system"
KUBE_VERSION = "v1.33.0"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

NAMESPACED = {
    "watchNamespaces": ["ml-a", "ml-b"],
    "replicas": 2,
    "image": {"repository": "registry.example/tandem-operator", "tag": "1.2.3", "pullPolicy": "Always"},
    "workerImage": {"repository": "registry.example/tandem-worker", "tag": "1.2.3"},
    "imagePullSecrets": [{"name": "registry"}],
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "podMonitor": {"enabled": True},
    "grafanaDashboard": {"enabled": True},
    "kubeStateMetrics": {"customResourceState": {"enabled": True}},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
    "priorityClassName": "system-cluster-critical",
}
KOPF_PEERING = {"leaderElection": {"enabled": False}}
"""Replicas coordinated through kopf's peering instead of a Lease (the chart's option)."""
VALUE_SETS = {
    "defaults": {},
    "namespaced-elected-monitored": NAMESPACED,
    "clusterwide-peered": {"replicas": 3, **KOPF_PEERING, "serviceMonitor": {"enabled": True},
                           "grafanaDashboard": {"enabled": True}},
    "namespaced-peered": {**NAMESPACED, **KOPF_PEERING},
    "one-standalone": {"replicas": 1, **KOPF_PEERING},
    "queues": {"kueue": {"enabled": True}, "gangScheduling": {"enabled": True}},
}
NO_OFFICIAL_SCHEMA = {"monitoring.coreos.com/v1"}
"""The Prometheus Operator's kinds: kubernetes-validate has no schema for them."""


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        rendered = chart.render(values, name="tandem", namespace=NAMESPACE, is_install=True)
    return [document for name, text in sorted(rendered.items()) if name.endswith(".yaml")
            for document in yaml.safe_load_all(text) if document]


def objects(values: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [o for o in render(values) if o["kind"] == kind]


def operator_container(values: dict[str, Any]) -> dict[str, Any]:
    (deployment,) = objects(values, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


# --- lint, render, validate ------------------------------------------------------------------------------------

@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_helm_lint_strict_is_clean(values):
    report = helm.lint(CHART, values, strict=True, kube_version=KUBE_VERSION, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error; 1 is info
    assert report["errors"] == [] and problems == []


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_rendered_object_is_valid(values):
    peering_crds = {crd["spec"]["names"]["kind"]: crd for crd in
                    yaml.safe_load_all((CHART / "crds" / "kopf.dev_peerings.yaml").read_text())}
    rendered = render(values)
    assert rendered
    for manifest in rendered:
        if manifest["apiVersion"] in NO_OFFICIAL_SCHEMA:
            assert manifest["kind"] in ("ServiceMonitor", "PodMonitor") and manifest["spec"]["selector"]
        elif manifest["apiVersion"] == "kopf.dev/v1":
            schema = peering_crds[manifest["kind"]]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            OAS30Validator(schema).validate(manifest)
        else:
            kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)


def test_the_chart_crds_are_the_repositorys_crds():
    """charts/tandem/crds/ holds copies of crds/ (`make crds` writes both) and kopf's peering CRDs."""
    ours = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert ours, "crds/ is empty"
    for name in ours:
        assert (CHART / "crds" / name).read_text() == (ROOT / "crds" / name).read_text(), \
            f"charts/tandem/crds/{name} differs from crds/{name}: run `make crds`"
    assert sorted(p.name for p in (CHART / "crds").glob("*.yaml")) == sorted([*ours, "kopf.dev_peerings.yaml"])
    with helm.Chart.load(CHART) as chart:
        loaded = {d["metadata"]["name"] for c in chart.crds for d in yaml.safe_load_all(c["data"]) if d}
    assert {"paralleltrainingjobs.tandem.dev", "inferencepools.tandem.dev",
            "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"} <= loaded


def test_the_charts_version_is_tandems():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["appVersion"] == PROJECT["version"]


@pytest.mark.parametrize(("values", "expected"), [
    ({"replicas": "two"}, ["replicas", "integer", "string"]),
    ({"replica": 2}, ["replica", "additional properties"]),
    ({"image": {"repository": "x", "tag": "1", "pullPolicy": "Sometimes"}}, ["/image/pullPolicy", "IfNotPresent"]),
    ({"watchNamespaces": ["ML_A"]}, ["watchNamespaces", "ML_A"]),
], ids=["wrong-type", "unknown-key", "bad-enum", "bad-namespace"])
def test_values_that_break_the_schema_are_refused_naming_the_key(values, expected):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as refused:
        chart.validate_schema(values)
    for words in expected:
        assert words.lower() in str(refused.value).lower(), str(refused.value)
    report = helm.lint(CHART, values, strict=True, kube_version=KUBE_VERSION)
    assert report["errors"] or any(m["severity"] == 3 for m in report["messages"])


# --- the operator's Deployment ---------------------------------------------------------------------------------

def test_the_deployment_runs_the_operator_with_options_it_accepts():
    container = operator_container(NAMESPACED)
    assert container["command"] == ["tandem", "operator"]
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert args.worker_image == "registry.example/tandem-worker:1.2.3"
    assert args.namespace == ["ml-a", "ml-b"]
    assert args.leader_elect and not args.peering and not args.standalone
    assert (args.leader_election_id, args.leader_election_namespace) == ("tandem", NAMESPACE)
    assert operator_main.election_problem(args) is None
    assert container["image"] == "registry.example/tandem-operator:1.2.3"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": args.health_port, "metrics": args.metrics_port}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}

    default = build_parser().parse_args(["operator", *operator_container({})["args"]])
    assert default.worker_image == "tandem-worker:0.1.0" and default.namespace == [] and default.leader_elect
    assert (default.leader_elect_lease_duration, default.leader_elect_renew_deadline,
            default.leader_elect_retry_period) == (15, 10, 2)  # controller-runtime's
    alone = build_parser().parse_args(["operator", *operator_container({"replicas": 1, **KOPF_PEERING})["args"]])
    assert alone.standalone and not alone.leader_elect
    refused = build_parser().parse_args(["operator", *operator_container(
        {"leaderElection": {"leaseDurationSeconds": 10, "renewDeadlineSeconds": 10}})["args"]])
    assert operator_main.election_problem(refused).startswith("--leader-elect-renew-deadline (10 s) must be shorter")
    assert not default.kueue and not default.gang_scheduling
    queues = build_parser().parse_args(["operator", *operator_container(QUEUES)["args"]])
    assert queues.kueue and queues.gang_scheduling


def test_the_operator_runs_as_the_images_non_root_user_with_a_read_only_root_and_no_capabilities():
    (deployment,) = objects({}, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == dockerfile_uid()
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "runAsNonRoot": True, "privileged": False,
                                            "capabilities": {"drop": ["ALL"]}}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",  # the new replica stands by till handed over
                                              "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    (alone,) = objects({"replicas": 1, **KOPF_PEERING}, "Deployment")
    assert alone["spec"]["strategy"]["type"] == "Recreate"  # one standalone replica never overlaps another


def test_elected_replicas_keep_one_through_voluntary_disruptions():
    (budget,) = objects({}, "PodDisruptionBudget")
    (deployment,) = objects({}, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert budget["spec"] == {"minAvailable": 1, "selector": deployment["spec"]["selector"]}
    assert objects({"replicas": 1}, "PodDisruptionBudget") == []
    assert objects({"podDisruptionBudget": {"enabled": False}}, "PodDisruptionBudget") == []


@pytest.mark.parametrize(("values", "kind", "namespaces"), [
    ({"replicas": 2, **KOPF_PEERING}, "ClusterKopfPeering", [None]),
    ({"replicas": 2, **KOPF_PEERING, "watchNamespaces": ["ml-a", "ml-b"]}, "KopfPeering", ["ml-a", "ml-b"]),
])
def test_replicas_peer_through_a_peering_object_the_chart_creates(values, kind, namespaces):
    rendered = render(values)
    peerings = [o for o in rendered if o["kind"] == kind]
    assert [o["metadata"].get("namespace") for o in peerings] == namespaces
    (deployment,) = (o for o in rendered if o["kind"] == "Deployment")
    assert f"--peering={peerings[0]['metadata']['name']}" in deployment["spec"]["template"]["spec"]["containers"][0][
        "args"]
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"


def test_peered_replicas_get_distinct_priorities_and_a_single_one_runs_standalone():
    """kopf pauses every operator that sees another of equal priority, so peered replicas must never tie."""
    parser = build_parser()
    peered = [operator_main.peering_options(parser.parse_args(["operator", "--peering", "tandem"])) for _ in range(5)]
    assert {p["peering_name"] for p in peered} == {"tandem"} and len({p["priority"] for p in peered}) == 5
    assert operator_main.peering_options(parser.parse_args(["operator", "--peering", "t", "--priority", "7"])) == {
        "peering_name": "t", "priority": 7}
    assert operator_main.peering_options(parser.parse_args(["operator", "--standalone"])) == {"standalone": True}
    assert operator_main.peering_options(parser.parse_args(["operator"])) == {}


# --- RBAC --------------------------------------------------------------------------------------------------------

def granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in rules if not rule.get("resourceNames")
            for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]}


def operator_permissions(values: dict[str, Any], namespace: str) -> set[tuple[str, str, str]]:
    """What the operator's ServiceAccount may do in `namespace`, from the rendered roles and their bindings."""
    rendered = render(values)
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in rendered
             if o["kind"] in ("ClusterRole", "Role")}
    permissions = set()
    for binding in (o for o in rendered if o["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        bound_namespace = binding["metadata"].get("namespace")
        if bound_namespace not in (None, namespace):
            continue
        assert {"kind": "ServiceAccount", "name": "tandem", "namespace": NAMESPACE} in binding["subjects"]
        ref = binding["roleRef"]
        role = roles[(ref["kind"], None if ref["kind"] == "ClusterRole" else bound_namespace, ref["name"])]
        permissions |= granted(role["rules"])
    return permissions


def example(path: str, kind: type) -> tuple[dict[str, Any], Any]:
    resource = load_one(ROOT / "examples" / path, kind)
    owner = {"apiVersion": resource.api_version, "kind": resource.kind,
             "metadata": {"name": resource.metadata.name, "namespace": "ml-a", "uid": "uid-1"}}
    return owner, resource


def built_objects() -> list[dict[str, Any]]:
    """Every kind of object the operator creates, as its own code builds them."""
    from tandem.api import InferencePool, ParallelTrainingJob

    job_owner, job = example("digits-train.yaml", ParallelTrainingJob)
    pool_owner, pool = example("digits-pool.yaml", InferencePool)
    return [
        training_objects.worker_pod(job_owner, job, 0, group=0, resume_from=None, default_image="w"),
        *training_objects.group_objects(job_owner, job),
        pool_objects.spec_config_map(pool_owner, pool),
        pool_objects.server_deployment(pool_owner, pool, job=None, pinned_step=None, default_image="w"),
        *pool_objects.server_access(pool_owner, pool),
        pool_objects.service(pool_owner, pool),
        pool_objects.disruption_budget(pool_owner, pool),
        pool_objects.autoscaler(pool_owner, pool),
    ]


RESOURCES = {"Pod": ("", "pods"), "Service": ("", "services"), "ConfigMap": ("", "configmaps"),
             "ServiceAccount": ("", "serviceaccounts"), "Role": ("rbac.authorization.k8s.io", "roles"),
             "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings"), "Deployment": ("apps", "deployments"),
             "PodDisruptionBudget": ("policy", "poddisruptionbudgets"),
             "HorizontalPodAutoscaler": ("autoscaling", "horizontalpodautoscalers")}
POOL_KINDS = {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
"""An InferencePool's objects are replaced (update) when the pool changes (and a job's ConfigMap when it exists)."""


@pytest.mark.parametrize("values", [{}, NAMESPACED], ids=["clusterwide", "namespaced"])
def test_the_operator_holds_every_verb_of_the_rank0_role_it_creates(values):
    """Kubernetes refuses to let the operator create a Role granting more than it holds itself."""
    from tandem.api import ParallelTrainingJob

    owner, job = example("digits-train.yaml", ParallelTrainingJob)
    (role,) = (o for o in training_objects.rank0_access(owner, job) if o["kind"] == "Role")
    wanted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
              for v in rule["verbs"]}
    assert wanted and wanted <= operator_permissions(values, "ml-a")


@pytest.mark.parametrize("values", [{}, NAMESPACED], ids=["clusterwide", "namespaced"])
def test_the_operator_holds_every_verb_of_the_server_role_it_creates(values):
    """A pool's servers read their pool (get and watch on it alone): the operator must hold both to grant them."""
    from tandem.api import InferencePool

    owner, pool = example("digits-pool.yaml", InferencePool)
    (role,) = (o for o in pool_objects.server_access(owner, pool) if o["kind"] == "Role")
    wanted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
              for v in rule["verbs"]}
    assert wanted == {("tandem.dev", "inferencepools", "get"), ("tandem.dev", "inferencepools", "watch")}
    assert [rule["resourceNames"] for rule in role["rules"]] == [[pool.metadata.name]], "that one pool, no other"
    assert wanted <= operator_permissions(values, "ml-a")


OWN_RESOURCES = {
    ("tandem.dev", "paralleltrainingjobs"): ["get", "list", "watch", "patch", "delete"],  # delete: the TTL
    ("tandem.dev", "paralleltrainingjobs/status"): ["get", "patch"],
    ("tandem.dev", "inferencepools"): ["get", "list", "watch", "patch"],  # get: the servers' Role grants it
    ("tandem.dev", "inferencepools/status"): ["patch"],
    ("tandem.dev", "paralleltrainingjobs/finalizers"): ["update"],  # blockOwnerDeletion on what it creates
    ("tandem.dev", "inferencepools/finalizers"): ["update"],
    ("", "events"): ["create"],
    ("apiextensions.k8s.io", "customresourcedefinitions"): ["list", "watch"],  # kopf
}


QUEUES = {"kueue": {"enabled": True}, "gangScheduling": {"enabled": True}}
QUEUE_VERBS = {
    ("kueue.x-k8s.io", "workloads"): ["list", "watch", "create", "delete"],  # a queued job's Workload, its index
    ("kueue.x-k8s.io", "workloads/status"): ["patch"],  # quota given back, PodsReady, Finished
    ("kueue.x-k8s.io", "resourceflavors"): ["get"],  # an admission's node labels and tolerations
    ("kueue.x-k8s.io", "workloadpriorityclasses"): ["get"],  # the Workload's priority
    ("scheduling.k8s.io", "priorityclasses"): ["get"],
    ("scheduling.x-k8s.io", "podgroups"): ["create", "patch"],  # spec.gang: the PodGroup, resized with its group
    ("scheduling.volcano.sh", "podgroups"): ["create", "patch"],
}


@pytest.mark.parametrize("values", [{}, NAMESPACED, QUEUES, {**NAMESPACED, **QUEUES}, {**NAMESPACED, **KOPF_PEERING},
                                    {"replicas": 2, **KOPF_PEERING}],
                         ids=["clusterwide", "namespaced", "queues", "namespaced-queues", "namespaced-peered",
                              "clusterwide-peered"])
def test_the_operator_may_do_exactly_what_it_does(values):
    """Least privilege: list and watch what kopf's indices read, create what the operator builds, update what it
    replaces (a pool's objects, a job's ConfigMap), delete rank pods and a pool's optional objects; its own
    resources' verbs; nothing else (no get it never calls, no wildcard)."""
    needed = {(g, r, v) for (g, r), verbs in OWN_RESOURCES.items() for v in verbs}
    for manifest in built_objects():
        group, resource = RESOURCES[manifest["kind"]]
        needed.add((group, resource, "create"))
        if manifest["kind"] not in ("ServiceAccount", "Role", "RoleBinding"):  # created once, never read
            needed |= {(group, resource, "list"), (group, resource, "watch")}
        if manifest["kind"] in POOL_KINDS:
            needed.add((group, resource, "update"))
    needed |= {("", "pods", "delete"), ("policy", "poddisruptionbudgets", "delete"),
               ("autoscaling", "horizontalpodautoscalers", "delete")}
    if values.get("kueue", {}).get("enabled"):
        needed |= {(g, r, v) for (g, r), verbs in QUEUE_VERBS.items() if "podgroups" not in r for v in verbs}
    if values.get("gangScheduling", {}).get("enabled"):
        needed |= {(g, r, v) for (g, r), verbs in QUEUE_VERBS.items() if r == "podgroups" for v in verbs}
    if values.get("watchNamespaces"):  # kopf's namespace observer runs only when it watches named namespaces
        needed |= {("", "namespaces", "list"), ("", "namespaces", "watch")}
    if values.get("replicas", 2) > 1 and values.get("leaderElection") == KOPF_PEERING["leaderElection"]:
        kind = "kopfpeerings" if values.get("watchNamespaces") else "clusterkopfpeerings"
        needed |= {("kopf.dev", kind, verb) for verb in ("get", "list", "watch", "patch")}
    permissions = operator_permissions(values, "ml-a")
    assert permissions == needed, (sorted(permissions - needed), sorted(needed - permissions))


def test_queues_grant_outside_the_watched_namespaces_only_the_cluster_scoped_reads():
    outside = operator_permissions({**NAMESPACED, **QUEUES}, "elsewhere") - operator_permissions(NAMESPACED,
                                                                                                  "elsewhere")
    assert outside == {("kueue.x-k8s.io", "resourceflavors", "get"), ("kueue.x-k8s.io", "workloadpriorityclasses",
                                                                      "get"), ("scheduling.k8s.io", "priorityclasses",
                                                                               "get")}


def test_a_namespaced_install_grants_nothing_outside_its_namespaces_but_what_kopf_reads():
    assert operator_permissions(NAMESPACED, "elsewhere") == {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("", "namespaces", "list"), ("", "namespaces", "watch")}
    assert ("kopf.dev", "kopfpeerings", "patch") in operator_permissions({**NAMESPACED, **KOPF_PEERING}, "ml-b")
    assert ("kopf.dev", "clusterkopfpeerings", "patch") in operator_permissions({"replicas": 2, **KOPF_PEERING}, "any")
    assert not any(g == "kopf.dev" for g, _, _ in operator_permissions({}, "any"))
    assert not any(g == "kopf.dev" for g, _, _ in operator_permissions(NAMESPACED, "ml-b"))


@pytest.mark.parametrize("values", [{}, NAMESPACED], ids=["clusterwide", "namespaced"])
def test_leader_election_may_create_leases_and_read_and_renew_only_its_own_in_its_own_namespace(values):
    """tandem operator --leader-elect creates its Lease, then reads and replaces (update) it: create on leases (RBAC
    cannot name an object before it exists), get and update on the Lease of that name; in the operator's namespace
    only. Without leader election: nothing on leases."""
    def lease_grants(values: dict[str, Any], namespace: str) -> set[tuple[str, ...]]:
        grants = set()
        for role in objects(values, "Role") + objects(values, "ClusterRole"):
            if role["metadata"].get("namespace") not in (None, namespace):
                continue
            for rule in role["rules"]:
                if "leases" in rule["resources"]:
                    grants |= {(verb, *rule.get("resourceNames", [])) for verb in rule["verbs"]}
        return grants

    (container,) = [operator_container(values)]
    args = build_parser().parse_args(["operator", *container["args"]])
    assert lease_grants(values, NAMESPACE) == {("create",), ("get", args.leader_election_id),
                                               ("update", args.leader_election_id)}
    assert args.leader_election_namespace == NAMESPACE
    assert lease_grants(values, "ml-a") == set() and lease_grants({**values, **KOPF_PEERING}, NAMESPACE) == set()
    (binding,) = [b for b in objects(values, "RoleBinding") if b["metadata"]["namespace"] == NAMESPACE]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tandem", "namespace": NAMESPACE}]


# --- monitoring ----------------------------------------------------------------------------------------------

def test_the_monitors_select_the_operator_and_the_inference_servers():
    from tandem.api import InferencePool

    rendered = render(NAMESPACED)
    (service_monitor,) = (o for o in rendered if o["kind"] == "ServiceMonitor")
    (service,) = (o for o in rendered if o["kind"] == "Service")
    assert service_monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service_monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}

    (pod_monitor,) = (o for o in rendered if o["kind"] == "PodMonitor")
    owner, pool = example("digits-pool.yaml", InferencePool)
    template = pool_objects.server_deployment(owner, pool, job=None, pinned_step=None, default_image="w")[
        "spec"]["template"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml-a", "ml-b"]}
    server_ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] in server_ports
    assert template["metadata"]["annotations"]["prometheus.io/path"] == pod_monitor["spec"]["podMetricsEndpoints"][
        0]["path"]


def real_metric_names() -> set[str]:
    """Every series name the operator, an inference server and the chart's kube-state-metrics configuration
    expose, as Prometheus stores them (counters with _total, histograms with _bucket, _sum, _count)."""
    from prometheus_client import REGISTRY

    import tandem.operator.metrics  # noqa: F401 (registers the operator's metrics)
    from tandem.api.inference import BatchingSettings
    from tandem.worker.serve.metrics import registry_for
    from tandem.worker.serve.stats import InferenceStats

    state = {"model": "m", "outcomes": dict.fromkeys(("success", "rejected", "failed", "invalid"), 0),
             "stats": InferenceStats().snapshot(), "pending": 0, "ready": True,
             "batching": BatchingSettings(batchLimit=8), "batch_limits": [8]}
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    names = {family.name + suffix for registry in (REGISTRY, registry_for(state))
             for family in registry.collect() for suffix in suffixes.get(family.type, [""])}
    config = yaml.safe_load((CHART / "dashboards" / "kube-state-metrics.yaml").read_text())
    for resource in config["spec"]["resources"]:
        names |= {f"{resource['metricNamePrefix']}_{metric['name']}" for metric in resource["metrics"]}
    return names


def test_the_dashboard_uses_only_real_metrics_and_shows_what_the_issue_asks():
    dashboard = json.loads((CHART / "dashboards" / "tandem.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    used = {name for p in panels for t in p["targets"] for name in re.findall(r"\btandem_[a-z_]+", t["expr"])}
    real = real_metric_names()
    assert used and used <= real, f"not exposed by anything: {sorted(used - real)}"
    titles = {p["title"] for p in panels}
    assert {"Jobs by phase", "Group restarts", "Training loss", "Samples per second", "Request rate", "p99 latency",
            "Queue depth", "Batch sizes"} <= titles
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    (configmap,) = (o for o in render(NAMESPACED) if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"])
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["tandem.json"]) == dashboard


def test_the_kube_state_metrics_configuration_reads_fields_the_crd_has():
    config = yaml.safe_load((CHART / "dashboards" / "kube-state-metrics.yaml").read_text())
    (resource,) = config["spec"]["resources"]
    crd = yaml.safe_load((ROOT / "crds" / "tandem.dev_paralleltrainingjobs.yaml").read_text())
    assert resource["groupVersionKind"] == {"group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"],
                                            "version": crd["spec"]["versions"][0]["name"]}
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for metric in resource["metrics"]:
        each = metric["each"]
        path = each[each["type"][0].lower() + each["type"][1:]]["path"]
        node = root
        for key in path:
            node = node["properties"][key]
        if each["type"] == "StateSet":
            assert each["stateSet"]["list"] == list(TrainingPhase.__args__)
        else:
            assert node["type"] in ("number", "integer"), (path, node)


# --- the images ------------------------------------------------------------------------------------------------

def dockerfile_stages() -> dict[str, dict[str, Any]]:
    """Each stage's base and instructions (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if match := re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.IGNORECASE):
            current = stages[match[2]] = {"base": match[1], "lines": []}
        elif current is not None:
            current["lines"].append(line)
    return stages


def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE))


def dockerfile_uid() -> int:
    return int(dockerfile_args()["UID"])


def lineage(stage: str) -> list[str]:
    stages = dockerfile_stages()
    chain = [stage]
    while stages[chain[-1]]["base"] in stages:
        chain.append(stages[chain[-1]]["base"])
    return chain


def pip_installs(stage: str) -> list[list[str]]:
    """The words of each `pip install` a stage and the stages it is built on run."""
    return [shlex.split(command) for name in lineage(stage) for line in dockerfile_stages()[name]["lines"]
            if line.startswith("RUN ") for command in line.removeprefix("RUN ").split("&&")
            if command.split()[:2] == ["pip", "install"]]


WHEEL_WITH_EXTRA = re.compile(r"tandem\[(\w+)\] @ file://\$\(echo /tmp/wheels/tandem-\*\.whl\)")
"""The tandem wheel the wheel stage built, with one of the extras pyproject.toml declares."""


def image_extra(stage: str) -> str:
    """The extra of the tandem wheel the stage's image installs; the install must name nothing else."""
    (install,) = [words for words in pip_installs(stage) if any("tandem" in word for word in words)]
    assert install[:4] == ["pip", "install", "-c", "/opt/tandem/constraints.txt"] and len(install) == 5, install
    match = WHEEL_WITH_EXTRA.fullmatch(install[4])
    assert match, install[4]
    return match[1]


def project_requirements(extra: str) -> list[str]:
    return [*PROJECT["dependencies"], *PROJECT["optional-dependencies"][extra]]


def constraint_pins() -> dict[str, str]:
    from packaging.utils import canonicalize_name

    return {canonicalize_name(name): version for name, version in
            (line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
             if "==" in line and not line.startswith("#"))}


def test_the_operator_image_has_no_torch_and_no_cuda():
    chain = lineage("operator")
    assert chain == ["operator", "runtime"] and dockerfile_stages()["runtime"]["base"] == "${PYTHON_BASE}"
    assert re.match(r"python:3\.12-slim", dockerfile_args()["PYTHON_BASE"])
    for stage in chain:
        for line in dockerfile_stages()[stage]["lines"]:
            assert not re.search(r"torch|cuda|nvidia", line, re.IGNORECASE), line


def test_the_images_install_the_packages_extras_and_nothing_kept_by_hand():
    """Each image installs what pyproject.toml says its part needs: the tandem wheel with the part's extra, pinned by
    constraints.txt, and no list of its own (the operator image nothing else at all; the worker image torch first,
    from the chosen variant's index), so a dependency added to the operator cannot be left out of its image."""
    assert image_extra("operator") == "operator" and image_extra("worker") == "worker"
    assert len(pip_installs("operator")) == 1
    (torch,) = [words for words in pip_installs("worker") if not any("tandem" in word for word in words)]
    assert [word for word in torch if not word.startswith(("-", "${"))] == ["pip", "install", "torch==${TORCH_VERSION}"]
    for stage in ("operator", "worker"):
        assert not any("--no-deps" in word for words in pip_installs(stage) for word in words)


def test_the_operator_extra_has_no_torch_and_no_grpc():
    closure = installed_closure([f"tandem[{image_extra('operator')}]"])
    assert {"kopf", "kubernetes", "prometheus-client", "pydantic"} <= closure
    assert not closure & {"torch", "grpcio", "tritonclient", "numpy", "protobuf"}, closure


@pytest.mark.parametrize("stage", ["operator", "worker"])
def test_what_each_image_installs_is_pinned_by_constraints(stage: str):
    """Every requirement of the image's extra is pinned, at a version that meets it; the operator image's whole
    closure too (the worker's brings what torch's index brings)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = constraint_pins()
    for line in project_requirements(image_extra(stage)):
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} ({stage} image) is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (line, pins[name])
    if stage == "operator":
        assert installed_closure(["tandem[operator]"]) - {"tandem"} <= set(pins)


PROBE = """
import json, re, sys, importlib.abc, importlib.machinery
from importlib.metadata import packages_distributions
allowed = set(json.loads(sys.argv[1]))
owners = packages_distributions()
refused = set()

def lacking(name):
    dists = owners.get(name.partition('.')[0])
    return bool(dists) and not any(re.sub(r'[-_.]+', '-', d).lower() in allowed for d in dists)

class NotInTheImage(importlib.abc.MetaPathFinder):
    # sys.path's finder, blind to the distributions the image lacks: importing one fails as it would there, and
    # importlib.util.find_spec answers None, as optional dependencies' probes expect.
    def find_spec(self, name, path=None, target=None):
        if lacking(name):
            refused.add(name)
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    def invalidate_caches(self):
        importlib.machinery.PathFinder.invalidate_caches()

startup = {'_distutils_hack'}  # setuptools' .pth shim, loaded by site before any import
assert not [m for m in sys.modules if lacking(m) and m not in startup], 'imported before the check'
assert importlib.machinery.PathFinder in sys.meta_path
sys.meta_path[:] = [NotInTheImage() if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
try:
    for module in sys.argv[2:]:
        __import__(module)
    from tandem.cli import build_parser
    build_parser().parse_args(["operator"])
except ImportError as error:
    sys.exit(f"{error} (refused as not in the image: {sorted(refused)})")
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'sklearn'))))
"""


def installed_closure(requirements: list[str]) -> set[str]:
    """The distributions pip installs for `requirements` (`tandem[operator]`): them and their requirements,
    recursively, with the extras they ask for (markers evaluated for this interpreter)."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        wanted = todo.pop()
        name, extras = canonicalize_name(wanted.name), frozenset(wanted.extras)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:  # tandem's own from pyproject.toml: an editable install's metadata may be older
            listed = ([*PROJECT["dependencies"], *(r for e in extras for r in PROJECT["optional-dependencies"][e])]
                      if name == "tandem" else requires(name) or [])
        except PackageNotFoundError:
            continue
        for line in listed:
            requirement = Requirement(line)
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append(requirement)
    return {name for name, _ in seen}


def import_with_only(allowed: set[str], modules: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, json.dumps(sorted(allowed)), *modules],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_the_operator_imports_with_only_what_its_image_installs():
    """The operator's whole import closure, in an interpreter that can import only the distributions the operator
    stage installs (tandem with its extra): every module in operator/, and the CLI that runs it."""
    allowed = installed_closure([f"tandem[{image_extra('operator')}]"])
    modules = ["kopf", "prometheus_client", "tandem.operator.main",
               *(f"tandem.operator.{p.stem}" for p in sorted((ROOT / "operator").glob("*.py")))]
    result = import_with_only(allowed, modules)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == []


@pytest.mark.parametrize(("module", "missing"), [("tandem.worker.train.preflight", "torch"),
                                               ("tandem.worker.train.trainer", "numpy"),
                                               ("tandem.worker.serve.grpc_service", "grpc")])
def test_the_image_check_fails_on_a_module_the_operator_extra_lacks(module: str, missing: str):
    allowed = installed_closure([f"tandem[{image_extra('operator')}]"])
    result = import_with_only(allowed, [module])
    assert result.returncode != 0 and f"No module named {missing!r} (refused as not in the image" in result.stderr


def test_the_worker_imports_with_only_what_its_image_installs():
    """The worker image installs the tandem wheel with its worker extra: the trainer, the server and the CLI must
    import with nothing else (a dependency only the test extra brings would pass every other test)."""
    allowed = installed_closure([f"tandem[{image_extra('worker')}]"])
    modules = ["tandem.worker.train.entrypoint", "tandem.worker.serve.app", "tandem.examples.digits",
               "tandem.backends.local"]
    result = import_with_only(allowed, modules)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_worker_image_pins_torch_as_constraints_do_and_both_run_as_the_pods_user():
    pins = constraint_pins()
    args = dockerfile_args()
    assert args["TORCH_VERSION"] == pins["torch"]
    worker = dockerfile_stages()["worker"]["lines"]
    assert any("torch==${TORCH_VERSION}" in line and "-c /opt/tandem/constraints.txt" in line for line in worker)
    assert dockerfile_uid() == pod_template.RUN_AS
    for stage in ("operator", "worker"):
        assert "USER ${UID}:${GID}" in dockerfile_stages()[stage]["lines"]


def test_dockerignore_lets_in_everything_the_build_copies():
    allowed = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    copied = [word.rstrip("/") for stage in dockerfile_stages().values() for line in stage["lines"]
              if line.startswith("COPY ") and "--from" not in line for word in line.split()[1:-1]]
    assert copied and set(copied) <= set(allowed)
    for path in copied:
        assert (ROOT / path).exists(), path


def test_helm_runs_in_process_from_the_bundled_library():
    """No helm binary, no download: helm-python-sdk loads the Helm library shipped inside its wheel."""
    assert Path(helm.library_path).is_relative_to(Path(helm.__file__).parent)
    assert helm.helm_sdk_version().startswith("v4.")

