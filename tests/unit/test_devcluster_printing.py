"""devcluster's pure parts that kubectl reads (tests/integration/test_kubectl.py runs kubectl itself): the Table
cells of tables.py (its ages are tandem/columns.py's human_duration, tested in test_columns.py), the discovery
entries of discovery.py, the undeclared fields of openapi.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from devcluster import discovery, openapi, tables
from devcluster.catalog import Catalog

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(("accept", "version"), [
    ("application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,"
     "application/json", "v1"),
    ("application/json;as=Table;v=v1beta1;g=meta.k8s.io, application/json", "v1beta1"),
    ("application/json", None), (None, None), ("*/*", None),
    ("application/json, application/json;as=Table;v=v1;g=meta.k8s.io", None),  # the first acceptable wins
    ("application/json;as=Table;v=v2;g=meta.k8s.io,application/json", None),
    ("application/json;as=PartialObjectMetadata;v=v1;g=meta.k8s.io,application/json", None),
])
def test_the_accept_header_chooses_a_table(accept, version):
    assert tables.table_version(accept) == version


JOB = {"metadata": {"name": "j", "creationTimestamp": "2026-12-01T11:59:15Z"},
       "status": {"phase": "Running", "restarts": 2, "progress": {"loss": 0.123456789, "steps": 7.9},
                  "conditions": [{"type": "Ready"}], "flag": True, "map": {"a": 1}}}


@pytest.mark.parametrize(("column", "cell"), [
    ({"type": "string", "jsonPath": ".status.phase"}, "Running"),
    ({"type": "string", "jsonPath": ".status.missing"}, None),
    ({"type": "string", "jsonPath": ".status.restarts"}, "2"),
    ({"type": "string", "jsonPath": ".status.flag"}, "true"),
    ({"type": "string", "jsonPath": ".status.map"}, '{"a":1}'),
    ({"type": "string", "jsonPath": ".status.conditions[0].type"}, "Ready"),
    ({"type": "string", "jsonPath": ".status.conditions[1].type"}, None),
    ({"type": "string", "jsonPath": "{.status.phase}"}, "Running"),
    ({"type": "string", "jsonPath": ".status.conditions[?(@.type=='Ready')].type"}, None),  # not evaluated here
    ({"type": "number", "jsonPath": ".status.progress.loss"}, 0.123456789),
    ({"type": "number", "jsonPath": ".status.restarts"}, 2.0),
    ({"type": "integer", "jsonPath": ".status.progress.steps"}, 7),
    ({"type": "integer", "jsonPath": ".status.phase"}, None),  # the wrong type: a null cell
    ({"type": "boolean", "jsonPath": ".status.flag"}, True),
    ({"type": "date", "jsonPath": ".metadata.creationTimestamp"}, "45s"),
    ({"type": "date", "jsonPath": ".status.phase"}, "<invalid>"),
])
def test_custom_columns_cells_as_the_api_server_makes_them(column, cell):
    assert tables.cell(column, JOB, NOW) == cell


def _pod(**status) -> dict:
    return {"metadata": {"name": "p", "creationTimestamp": "2026-12-01T11:00:00Z"},
            "spec": {"containers": [{"name": "main"}], "nodeName": "node"},
            "status": {"phase": "Running", "podIP": "127.0.0.2", **status}}


def _container(state: dict, ready: bool = False, restarts: int = 0, **more) -> dict:
    return {"containerStatuses": [{"state": state, "ready": ready, "restartCount": restarts, **more}]}


@pytest.mark.parametrize(("pod", "ready", "status", "restarts"), [
    (_pod(**_container({"running": {}}, ready=True)), "1/1", "Running", "0"),
    (_pod(**_container({"running": {}})), "0/1", "Running", "0"),
    (_pod(phase="Pending", **_container({"waiting": {"reason": "ContainerCreating"}})), "0/1", "ContainerCreating",
     "0"),
    (_pod(phase="Succeeded", **_container({"terminated": {"reason": "Completed", "exitCode": 0}})), "0/1",
     "Completed", "0"),
    (_pod(phase="Failed", **_container({"terminated": {"exitCode": 3}})), "0/1", "ExitCode:3", "0"),
    (_pod(phase="Failed", **_container({"terminated": {"exitCode": 137, "signal": 9}})), "0/1", "Signal:9", "0"),
    (_pod(**_container({"running": {}}, ready=True, restarts=2, lastState={
        "terminated": {"finishedAt": (NOW - timedelta(seconds=30)).isoformat()}})), "1/1", "Running", "2 (30s ago)"),
    ({**_pod(), "metadata": {**_pod()["metadata"], "deletionTimestamp": "2026-12-01T11:59:00Z"}}, "0/1",
     "Terminating", "0"),
    (_pod(phase="Pending"), "0/1", "Pending", "0"),
])
def test_pod_columns_as_kubectls_pod_printer(pod, ready, status, restarts):
    assert tables.pod_cells(pod, NOW) == [ready, status, restarts, "60m", "127.0.0.2", "node", "<none>", "<none>"]


def test_a_table_of_a_custom_resource_and_its_row_objects():
    catalog = Catalog()
    columns = ({"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
               {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "priority": 1},
               {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp", "priority": 0})
    kind = catalog.lookup("pods").__class__(group="x.dev", version="v1", plural="things", kind="Thing",
                                            namespaced=True, schema={"type": "object"}, printer_columns=columns)
    table = tables.table(kind, [JOB], now=NOW, resource_version="9")
    # every column, each with its priority: kubectl leaves those above 0 out unless `-o wide`
    assert [(c["name"], c["priority"]) for c in table["columnDefinitions"]] == [
        ("Name", 0), ("Phase", 0), ("Restarts", 1), ("Age", 0)]
    assert table["rows"] == [{"cells": ["j", "Running", 2, "45s"], "object": {
        "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": JOB["metadata"]}}]
    assert tables.table(kind, [JOB], now=NOW, include="Object")["rows"][0]["object"] == JOB
    assert "object" not in tables.table(kind, [JOB], now=NOW, include="None")["rows"][0]
    bare = kind.__class__(**{**kind.__dict__, "printer_columns": ()})
    assert [c["name"] for c in tables.table(bare, [JOB], now=NOW)["columnDefinitions"]] == ["Name", "Age"]
    configmaps = tables.table(catalog.lookup("configmaps"), [JOB], now=NOW)
    assert [c["name"] for c in configmaps["columnDefinitions"]] == ["Name", "Created At"]
    assert configmaps["rows"][0]["cells"] == ["j", "2026-12-01T11:59:15Z"]


def test_discovery_lists_subresources_without_short_names_and_with_their_own_verbs():
    catalog = Catalog()
    core = discovery.document(catalog, "/api/v1")
    assert core["groupVersion"] == "v1"
    entries = {entry["name"]: entry for entry in core["resources"]}
    assert entries["pods"]["shortNames"] == ["po"] and "list" in entries["pods"]["verbs"]
    assert "shortNames" not in entries["pods/status"] and entries["pods/status"]["verbs"] == ["get", "patch", "update"]
    assert entries["pods/eviction"]["kind"] == "Eviction" and entries["pods/eviction"]["group"] == "policy"
    apps = {entry["name"]: entry for entry in discovery.document(catalog, "/apis/apps/v1")["resources"]}
    assert (apps["deployments/scale"]["kind"], apps["deployments/scale"]["group"]) == ("Scale", "autoscaling")
    groups = discovery.document(catalog, "/apis")["groups"]
    assert "apps" in [g["name"] for g in groups] and "" not in [g["name"] for g in groups]
    assert discovery.document(catalog, "/apis/nothing.dev/v1") is None
    assert discovery.document(catalog, "/api/v1/pods") is None


SCHEMA = {"type": "object", "properties": {
    "spec": {"type": "object", "properties": {
        "workers": {"type": "integer"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "items": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}}},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}


@pytest.mark.parametrize(("obj", "unknown"), [
    ({"apiVersion": "x/v1", "kind": "X", "metadata": {"name": "a"}, "spec": {"workers": 2}}, []),
    ({"spec": {"workerz": 2}}, ["spec.workerz"]),
    ({"spec": {"labels": {"any": "thing"}, "free": {"what": {"ever": 1}}}}, []),
    ({"spec": {"items": [{"name": "a"}, {"nmae": "b"}]}}, ["spec.items[1].nmae"]),
    ({"spec": {}, "extra": 1}, ["extra"]),
])
def test_a_strict_write_names_each_undeclared_field(obj, unknown):
    assert openapi.unknown_fields(obj, SCHEMA) == unknown


def test_openapi_announces_field_validation_for_each_kind_it_serves():
    catalog = Catalog()
    index = openapi.document(catalog, "/openapi/v3")["paths"]
    assert "api/v1" in index and "apis/apps/v1" in index
    assert index["api/v1"]["serverRelativeURL"].startswith("/openapi/v3/api/v1?hash=")
    core = openapi.document(catalog, "/openapi/v3/api/v1")
    patch = core["paths"]["/api/v1/namespaces/{namespace}/pods/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {"group": "", "version": "v1", "kind": "Pod"}
    assert "fieldValidation" in [p["name"] for p in patch["parameters"] if p["in"] == "query"]
    assert "application/strategic-merge-patch+json" not in patch["requestBody"]["content"]
    assert openapi.document(catalog, "/openapi/v3/apis/nothing.dev/v1") is None
