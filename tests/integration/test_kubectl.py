"""The real `kubectl` (Debian's kubernetes-client) against the emulated API server (devcluster/), and the README's
kubectl commands run with it: discovery (devcluster/discovery.py), server-side printing of the CRDs' printer
columns and of pods (tables.py), `apply`'s validation through the OpenAPI v3 documents (openapi.py), `describe`,
`scale`, `patch`, `get -w` and `delete`; the quick start with the real operator training the digits example and
serving it.

Skipped, with the reason, where `kubectl` is not on PATH or older than 1.27 (`OLDEST`; Debian bookworm's
kubernetes-client is 1.20, so `make setup` installs nothing: kubectl's own release, or a distribution's recent one).

The README's samples are compared with what kubectl prints column by column: equal, but for the numbers a run
measures (LOSS, SAMPLES/S, ETA while running) and ages, which must have the format kubectl prints them in (LOSS four
significant figures, rank 0's `status.progress.lossText`; SAMPLES/S; ETA and AGE as Kubernetes' ages); `-o wide`
adds the columns of priority 1 (QUEUE, the full paths, the pool's ENDPOINT and gate METRIC).
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import subprocess
import threading

import pytest
import yaml
from jobs import ROOT, TESTS
from kubectl_tables import table
from operator_runs import NS, READY, STARTUP, custom_job, events, job_pods, server_pods, start_operator

from devcluster import Cluster
from tandem.api import ParallelTrainingJobStatus
from tandem.columns import four_figures

# kubectl 1.27 and later validate `apply` on the server through the OpenAPI v3 documents; older ones (Debian
# bookworm's kubernetes-client is 1.20) only against /openapi/v2 in protobuf, which devcluster does not serve.
OLDEST = (1, 27)


def kubectl_missing() -> str | None:
    if shutil.which("kubectl") is None:
        return "needs `kubectl` >= 1.27 on PATH (none found)"
    try:
        found = json.loads(subprocess.run(["kubectl", "version", "--client", "-o", "json"], capture_output=True,
                                          text=True, timeout=30).stdout)["clientVersion"]
        version = (int(found["major"]), int(found["minor"].rstrip("+")))
    except (ValueError, KeyError, OSError, subprocess.SubprocessError) as error:
        return f"`kubectl version --client` unreadable: {error!r}"
    if version < OLDEST:
        return f"needs `kubectl` >= 1.27 (found {found.get('gitVersion')}: it cannot validate apply via OpenAPI v3)"
    return None


pytestmark = pytest.mark.skipif(bool(MISSING := kubectl_missing()), reason=MISSING or "")

README = (ROOT / "README.md").read_text()
README_AND_DOCS = "\n".join([README, *(path.read_text() for path in sorted((ROOT / "docs").glob("*.md")))])  # the
# README's deep sections are in docs/
QUICK_START = README.split("\n## Quick start on a cluster", 1)[1].split("\n## ", 1)[0]
TRAIN, POOL = ROOT / "examples" / "digits-train.yaml", ROOT / "examples" / "digits-pool.yaml"
AGE = re.compile(r"\d+[smhdy](\d+[smh])?")
FOUR_FIGURES = r"-?(\d\.\d{3}(e[+-]\d+)?|0\.0*[1-9]\d{3}|[1-9]\d\.\d{2}|[1-9]\d{2}\.\d|[1-9]\d{3})|NaN|-?Inf"
"""A loss as kubectl's LOSS column prints it (tandem/columns.py): four significant figures."""
RATE = r"\d+(\.\d+)?"
MEASURED = {"LOSS": FOUR_FIGURES, "SAMPLES/S": RATE}
"""What a run measures: compared with the README's sample by format."""


def is_age(text: str) -> bool:
    """Whether kubectl could print `text` as an age (HumanDuration: `119s` then `2m`, `2m5s`...; never `1m`)."""
    if seconds := re.fullmatch(r"(\d+)s", text):
        return int(seconds[1]) < 120
    if minutes := re.fullmatch(r"(\d+)m(?:(\d+)s)?", text):
        return int(minutes[1]) >= 2 and (minutes[2] is None or (int(minutes[1]) < 10 and 0 < int(minutes[2]) < 60))
    return bool(AGE.fullmatch(text))


def kubectl_layout(rows: list[list[str]]) -> list[str]:
    """Rows laid out as kubectl's tabwriter does: each column as wide as its widest cell, then three spaces."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["".join(cell.ljust(width + 3) for cell, width in zip(row[:-1], widths, strict=False)) + row[-1]
            for row in rows]


def kubectl(cluster: Cluster, *args: str, input: str | None = None, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
    env = cluster.environ(KUBECACHEDIR=str(cluster.root / "kubectl-cache"), HOME=str(cluster.root))
    result = subprocess.run(["kubectl", *args], env=env, input=input, capture_output=True, text=True, timeout=60,
                            cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} exited {result.returncode}: {result.stderr}")
    return result


def readme_samples(section: str = QUICK_START) -> list[dict[str, str]]:
    """The `kubectl get` samples of a README section (four-space indented, a NAME header and one row each)."""
    blocks = re.findall(r"\n(    NAME .*\n    \S.*)\n", section)
    return [table("\n".join(line[4:] for line in block.splitlines()))[0] for block in blocks]


def differences(sample: dict[str, str], printed: dict[str, str], known: dict[str, str]) -> list[str]:
    """The columns where kubectl's row is not the README's, but for those `known` explains (each still checked for
    its format)."""
    assert list(sample) == list(printed), (list(sample), list(printed))
    found = []
    for column, value in printed.items():
        if column == "AGE":
            ok = is_age(value) and is_age(sample[column])
        elif column in known:
            ok = re.fullmatch(known[column], value) and re.fullmatch(known[column], sample[column])
        else:
            ok = value == sample[column]
        if not ok:
            found.append(f"{column}: README {sample[column]!r}, kubectl {value!r}")
    return found


# --- the emulated API as kubectl needs it (no operator) ---------------------------------------------------------

@pytest.fixture
def cluster(tmp_path):
    with Cluster(tmp_path) as cluster:
        yield cluster


def test_discovery_names_every_resource_once_without_warnings(cluster):
    resources = kubectl(cluster, "api-resources")
    assert resources.stderr == ""
    rows = {row["NAME"]: row for row in table(resources.stdout)}
    assert rows["pods"]["SHORTNAMES"] == "po" and rows["pods"]["APIVERSION"] == "v1"
    assert rows["paralleltrainingjobs"]["SHORTNAMES"] == "ptj,trainingjob,trainingjobs"
    assert rows["inferencepools"]["APIVERSION"] == "tandem.dev/v1alpha1" and rows["inferencepools"]["KIND"] == \
        "InferencePool"
    for name in ("pods", "events", "services", "configmaps", "persistentvolumeclaims", "ptj", "tip", "ns"):
        got = kubectl(cluster, "get", name)
        assert "Warning" not in got.stderr and got.returncode == 0, (name, got.stderr)


def test_get_prints_the_crds_columns_as_the_api_server_fills_them(cluster):
    """The README's sample of a running job, from the status rank 0 would write for it: the loss to four figures
    while `status.progress.loss` keeps every digit, samples/s, the ETA, the checkpoint's file; `-o wide` adds the
    queue and the checkpoint's path."""
    kubectl(cluster, "apply", "-f", str(TRAIN))
    empty = table(kubectl(cluster, "get", "ptj").stdout)
    assert empty == [{"NAME": "digits-train", "PHASE": "", "READY": "", "STEP": "", "LOSS": "", "SAMPLES/S": "",
                      "ETA": "", "RESTARTS": "", "CHECKPOINT": "", "AGE": empty[0]["AGE"]}]  # no status: null cells
    sample = readme_samples()[0]
    step, total = (int(n) for n in sample["STEP"].split("/"))
    loss, path = 0.18741234567, f"/var/lib/tandem/checkpoints/runs/digits-train/checkpoints/{sample['CHECKPOINT']}"
    written = ParallelTrainingJobStatus.model_validate({
        "phase": sample["PHASE"], "restarts": int(sample["RESTARTS"]), "workers": {"ready": 2, "total": 2},
        "progress": {"step": step, "totalSteps": total, "loss": loss, "samplesPerSecond": 1818.4,
                     "etaSeconds": 6.7}, "checkpoint": {"latest": path}}).to_dict()
    status, _ = cluster.request("PATCH", f"/apis/tandem.dev/v1alpha1/namespaces/{NS}/paralleltrainingjobs/digits-train"
                                "/status", {"status": written}, "application/merge-patch+json")
    assert status == 200
    for resource in ("trainingjobs", "ptj", "paralleltrainingjobs.tandem.dev"):
        (row,) = table(kubectl(cluster, "get", resource).stdout)
        assert differences(sample, row, {}) == [], row  # every column as the README shows it, LOSS `0.1874` too
    (wide,) = table(kubectl(cluster, "get", "ptj", "-o", "wide").stdout)
    assert list(wide) == [*list(sample)[:-1], "QUEUE", "LENT", "CHECKPOINT PATH", "AGE"]  # the columns of priority 1
    assert (wide["QUEUE"], wide["LENT"], wide["CHECKPOINT PATH"]) == ("", "", path)
    assert kubectl(cluster, "get", "ptj", "digits-train", "-o", "jsonpath={.status.progress.loss}").stdout == \
        str(loss)  # the status keeps every digit


def test_get_watch_prints_a_row_for_each_change(cluster):
    kubectl(cluster, "apply", "-f", str(TRAIN))
    env = cluster.environ(KUBECACHEDIR=str(cluster.root / "kubectl-cache"), HOME=str(cluster.root))
    with subprocess.Popen(["kubectl", "get", "ptj", "digits-train", "-w"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as watch:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in watch.stdout], daemon=True).start()
        try:
            header, first = lines.get(timeout=30), lines.get(timeout=30)
            # kubectl GETs the object, prints it, then watches from resourceVersion 0 and does not print that watch's
            # first event (the state it printed): a change made before its watch is open would never be printed.
            cluster.wait_for(lambda: cluster.emulator.watches("paralleltrainingjobs") == 1, 30, "kubectl's watch")
            cluster.request("PATCH", f"/apis/tandem.dev/v1alpha1/namespaces/{NS}/paralleltrainingjobs/digits-train"
                            "/status", {"status": {"phase": "Running", "workers": {"summary": "2/2"}}},
                            "application/merge-patch+json")
            changed = lines.get(timeout=30)
        finally:
            watch.kill()
    rows = table(header + first + changed)
    assert [(row["NAME"], row["PHASE"], row["READY"]) for row in rows] == [
        ("digits-train", "", ""), ("digits-train", "Running", "2/2")], rows


def test_get_pods_prints_the_builtin_columns(cluster):
    kubectl(cluster, "run", "hello", "--image", "python", "--restart", "Never", "--command", "--",
            "python", "-c", "print(1)")
    cluster.wait_for(lambda: cluster.get("pods", NS, "hello")["status"]["phase"] == "Succeeded", 30, "hello")
    (row,) = table(kubectl(cluster, "get", "pods").stdout)
    assert {key: row[key] for key in ("NAME", "READY", "STATUS", "RESTARTS")} == {
        "NAME": "hello", "READY": "0/1", "STATUS": "Completed", "RESTARTS": "0"} and AGE.fullmatch(row["AGE"])
    (wide,) = table(kubectl(cluster, "get", "pods", "-o", "wide").stdout)
    pod = cluster.get("pods", NS, "hello")
    assert (wide["IP"], wide["NODE"], wide["NOMINATED NODE"], wide["READINESS GATES"]) == (
        pod["status"]["podIP"], pod["spec"]["nodeName"], "<none>", "<none>")
    assert kubectl(cluster, "logs", "hello").stdout == "1\n"


def test_apply_validates_against_the_crds_schema(cluster, tmp_path):
    manifest = yaml.safe_load(TRAIN.read_text())
    unknown = {**manifest, "spec": {**manifest["spec"], "workerz": 2}}
    refused = kubectl(cluster, "apply", "-f", "-", input=json.dumps(unknown), check=False)
    assert refused.returncode == 1
    assert 'strict decoding error: unknown field "spec.workerz"' in refused.stderr, refused.stderr
    assert cluster.get("ptj", NS, "digits-train") is None
    wrong = {**manifest, "spec": {**manifest["spec"], "workers": "two"}}
    refused = kubectl(cluster, "apply", "-f", "-", input=json.dumps(wrong), check=False)
    assert refused.returncode == 1 and "* spec.workers: 'two' is not of type 'integer'" in refused.stderr, \
        refused.stderr
    assert kubectl(cluster, "apply", "-f", str(TRAIN)).stdout == "paralleltrainingjob.tandem.dev/digits-train created\n"
    assert kubectl(cluster, "apply", "-f", str(TRAIN)).stdout == \
        "paralleltrainingjob.tandem.dev/digits-train unchanged\n"
    again = kubectl(cluster, "apply", "-f", "-", input=json.dumps(unknown), check=False)
    assert again.returncode == 1 and 'unknown field "spec.workerz"' in again.stderr  # a patch is validated too
    ignored = kubectl(cluster, "apply", "--validate=false", "-f", "-", input=json.dumps(unknown))
    assert "configured" in ignored.stdout and "workerz" not in cluster.get("ptj", NS, "digits-train")["spec"]


# --- the README's commands, with the real operator ----------------------------------------------------------------

@pytest.fixture(scope="module")
def operated(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("cluster"), extra_env={"PYTHONPATH": str(TESTS)}) as cluster:
        start_operator(cluster)
        yield cluster


def status(cluster: Cluster, resource: str, name: str) -> dict:
    return (cluster.get(resource, NS, name) or {}).get("status") or {}


def wait_phase(cluster: Cluster, resource: str, name: str, phase: str, timeout: float) -> dict:
    try:
        return cluster.wait_for(lambda: (s := status(cluster, resource, name)).get("phase") == phase and s, timeout,
                                f"{name} to be {phase}")
    except TimeoutError:
        print(cluster.process_log("operator")[-4000:])
        raise AssertionError(f"{name} is not {phase}: {status(cluster, resource, name)}") from None


def test_the_quick_start_runs_with_kubectl(operated):
    """The quick start's commands as the README gives them: the claim from a heredoc, the job through `kubectl
    patch --local | kubectl apply -f -`, `kubectl get trainingjobs` / `ptj` against the Succeeded sample, `kubectl
    describe ptj`, the pool and `kubectl get tip`, a pool patched to one replica, and the clean-up's deletes."""
    cluster = operated
    commands = QUICK_START.split("```sh\n", 2)[2].split("```", 1)[0]
    claim = commands.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    assert kubectl(cluster, "apply", "-f", "-", input=claim).stdout == \
        "persistentvolumeclaim/digits-checkpoints created\n"
    patch = re.search(r"kubectl patch -f examples/digits-train\.yaml --local --type merge -o yaml \\\n\s+-p '([^']+)'",
                      commands).group(1)
    local = kubectl(cluster, "patch", "-f", "examples/digits-train.yaml", "--local", "--type", "merge", "-o", "yaml",
                    "-p", patch).stdout
    assert kubectl(cluster, "apply", "-f", "-", input=local).stdout == \
        "paralleltrainingjob.tandem.dev/digits-train created\n"
    final = wait_phase(cluster, "ptj", "digits-train", "Succeeded", 240)
    running, succeeded, pool_sample = readme_samples()
    for resource in ("trainingjobs", "ptj"):
        printed = kubectl(cluster, "get", resource).stdout
        print(printed)  # what the README's samples are compared with
        (row,) = table(printed)
        assert row["LOSS"] == four_figures(final["progress"]["loss"])
        assert differences(succeeded, row, MEASURED) == [], row  # the ETA blank: the job is not running

    described = kubectl(cluster, "describe", "ptj", "digits-train").stdout
    print(described)
    conditions = described.split("\n  Conditions:\n", 1)[1].split("\nEvents:", 1)[0]
    assert final["conditions"]
    for condition in final["conditions"]:  # each readable as `Type: Succeeded`, `Status: True`, `Reason: ...`
        assert re.search(rf"\n\s+Type:\s+{condition['type']}\n", "\n" + conditions + "\n"), (condition, conditions)
        assert re.search(rf"Reason:\s+{condition['reason']}\n", conditions), (condition, conditions)
    event_lines = described.split("\nEvents:\n", 1)[1]
    for reason in events(cluster, "digits-train"):
        assert re.search(rf"Normal\s+{reason}\s", event_lines), (reason, event_lines)

    assert kubectl(cluster, "apply", "-f", "examples/digits-pool.yaml").stdout == \
        "inferencepool.tandem.dev/digits created\n"
    wait_phase(cluster, "tip", "digits", "Ready", READY * 2)
    cluster.wait_for(lambda: status(cluster, "tip", "digits").get("readyReplicas") == 2, READY, "both servers")
    printed = kubectl(cluster, "get", "tip").stdout
    print(printed)
    (row,) = table(printed)
    assert differences(pool_sample, row, {}) == [], row
    (wide,) = table(kubectl(cluster, "get", "tip", "-o", "wide").stdout)
    assert list(wide) == [*list(pool_sample)[:-1], "ENDPOINT", "CHECKPOINT PATH", "METRIC", "BORROWED", "AGE"]
    assert (wide["ENDPOINT"], wide["METRIC"], wide["BORROWED"]) == (status(cluster, "tip", "digits")["endpoint"], "",
                                                                    "")  # no gate, no loan
    assert wide["CHECKPOINT PATH"].endswith("/runs/digits-train/checkpoints/step-00000230.pt"), wide

    assert kubectl(cluster, "patch", "tip", "digits", "--type", "merge", "-p",
                   '{"spec": {"replicas": 1, "autoscaling": null}}').stdout == \
        "inferencepool.tandem.dev/digits patched\n"
    cluster.wait_for(lambda: len(server_pods(cluster, "digits")) == 1, READY, "one server")
    cluster.wait_for(lambda: table(kubectl(cluster, "get", "tip").stdout)[0]["READY"] == "1/1", READY, "READY 1/1")

    deleted = kubectl(cluster, "delete", "-f", "examples/digits-pool.yaml", "-f", "examples/digits-train.yaml").stdout
    assert deleted.splitlines() == ['inferencepool.tandem.dev "digits" deleted',
                                    'paralleltrainingjob.tandem.dev "digits-train" deleted']
    assert kubectl(cluster, "delete", "pvc", "digits-checkpoints").stdout == \
        'persistentvolumeclaim "digits-checkpoints" deleted\n'
    cluster.wait_for(lambda: not job_pods(cluster, "digits-train") and not server_pods(cluster, "digits"), 60,
                     "the pods to go")
    left = kubectl(cluster, "get", "ptj,tip,pvc,deployments,services")
    assert left.stdout == "" and left.stderr == "No resources found in default namespace.\n", left


def test_scale_and_suspend_with_kubectl(operated):
    """`kubectl scale ptj/NAME --replicas N` restarts the group at the new size; `kubectl patch` with `suspend:
    true` stops the ranks, and `kubectl get ptj` shows each: the ETA rank 0 wrote while it ran is blank once
    Suspended (the operator removes it)."""
    cluster = operated
    kubectl(cluster, "apply", "-f", "-", input=json.dumps(custom_job("sleepy")))
    wait_phase(cluster, "ptj", "sleepy", "Running", STARTUP)
    assert kubectl(cluster, "scale", "ptj/sleepy", "--replicas", "3").stdout == \
        "paralleltrainingjob.tandem.dev/sleepy scaled\n"
    cluster.wait_for(lambda: status(cluster, "ptj", "sleepy").get("phase") == "Running"
                     and status(cluster, "ptj", "sleepy")["workers"]["summary"] == "3/3", STARTUP, "three ranks")
    eta = {"progress": {"etaSeconds": 40.0, "etaText": "40s"}}  # as rank 0 writes it (a custom command does not)
    assert cluster.request("PATCH", f"/apis/tandem.dev/v1alpha1/namespaces/{NS}/paralleltrainingjobs/sleepy/status",
                           {"status": eta}, "application/merge-patch+json")[0] == 200
    (row,) = table(kubectl(cluster, "get", "ptj", "sleepy").stdout)
    assert (row["PHASE"], row["READY"], row["ETA"]) == ("Running", "3/3", "40s"), row
    assert kubectl(cluster, "patch", "ptj", "sleepy", "--type", "merge", "-p", '{"spec": {"suspend": true}}').stdout \
        == "paralleltrainingjob.tandem.dev/sleepy patched\n"
    wait_phase(cluster, "ptj", "sleepy", "Suspended", STARTUP)
    cluster.wait_for(lambda: not [p for p in job_pods(cluster, "sleepy") if p["status"].get("phase") == "Running"],
                     STARTUP, "the ranks to stop")
    cluster.wait_for(lambda: table(kubectl(cluster, "get", "ptj", "sleepy").stdout)[0]["ETA"] == "", STARTUP,
                     "the ETA to be removed")
    (row,) = table(kubectl(cluster, "get", "ptj", "sleepy").stdout)
    assert row["PHASE"] == "Suspended", row
    assert "etaSeconds" not in status(cluster, "ptj", "sleepy")["progress"]
    described = kubectl(cluster, "describe", "ptj", "sleepy").stdout
    assert "Suspend:" in described and "Suspended" in described
    kubectl(cluster, "delete", "ptj", "sleepy")
    cluster.wait_for(lambda: not job_pods(cluster, "sleepy"), 60, "sleepy's pods to go")


def test_readme_samples_are_laid_out_as_kubectl_prints_them():
    """Every `kubectl get` sample of the README: columns aligned as kubectl aligns them, an age kubectl can print;
    and the quick start's three, which this file compares with (so that a README edit cannot make the comparisons
    vacuous)."""
    blocks = re.findall(r"\n(    NAME .*\n    \S.*)\n", README_AND_DOCS)
    assert len(blocks) == 6  # the status sample is in the README and in docs/operator.md
    for block in blocks:
        (row,) = table("\n".join(line[4:] for line in block.splitlines()))
        assert kubectl_layout([list(row), list(row.values())]) == [line[4:] for line in block.splitlines()], block
        assert is_age(row["AGE"]), block
    running, succeeded, pool = readme_samples()
    assert (running["PHASE"], succeeded["PHASE"], pool["PHASE"]) == ("Running", "Succeeded", "Ready")
    assert len(running) == 10 and len(pool) == 7 and succeeded["ETA"] == ""

