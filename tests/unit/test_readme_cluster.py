"""The README's cluster-user parts say what the code does: the quick start's manifests and `kubectl get` samples,
every Tandem field and Python argument the DL4J and Kubeflow tables name, and the troubleshooting section's status
messages, each made here by the code that writes it, from the README's example values.

(tests/integration/test_readme.py runs the README's Python examples; this file needs no process and no cluster.)"""

from __future__ import annotations

import inspect
import itertools
import json
import keyword
import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args

import pytest
import torch
import yaml

from tandem import ParallelInference, ParallelWrapper
from tandem.api import InferencePool
from tandem.api.training import TrainerSpec, TrainingMode
from tandem.backends.local import PreflightError, preflight
from tandem.examples.digits import mlp
from tandem.manifest import (
    merge_patched,  # RFC 7386, as `kubectl patch --type merge`
    parse,
)
from tandem.operator import pools
from tandem.operator.api_policy import Refused
from tandem.operator.daemon import describe_refusal
from tandem.operator.observed import read_resource
from tandem.operator.training import Settings, reconcile
from tandem.operator.training_objects import GROUP_LABEL, MASTER_PORT, RANK_LABEL, master_address
from tandem.worker import checkpoint
from tandem.worker.serve import inference
from tandem.worker.train import process_group
from tandem.worker.train.nonfinite import StepRecord

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SECTIONS = {part.split("\n", 1)[0]: part for part in README.split("\n## ")[1:]}
QUICK_START = SECTIONS["Quick start on a cluster"]
# The mapping and the troubleshooting cases are in docs/, linked from the README's sections of those names (the
# name clash's case stays in the README).
MAPPING = (ROOT / "docs" / "coming-from.md").read_text()
TROUBLESHOOTING = SECTIONS["Troubleshooting"] + "\n" + (ROOT / "docs" / "troubleshooting.md").read_text()
CRDS = {kind: yaml.safe_load((ROOT / "crds" / f"tandem.dev_{plural}.yaml").read_text())
        for kind, plural in (("ParallelTrainingJob", "paralleltrainingjobs"), ("InferencePool", "inferencepools"))}


def crd_version(kind: str) -> dict[str, Any]:
    (version,) = CRDS[kind]["spec"]["versions"]
    return version


def flat(text: str) -> str:
    return " ".join(text.split())


# --- the quick start -------------------------------------------------------------------------------------------

def test_the_quick_starts_job_is_the_example_with_its_checkpoints_on_the_claim_it_creates():
    claim = yaml.safe_load(QUICK_START.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0])
    assert claim["kind"] == "PersistentVolumeClaim"
    patch = json.loads(re.search(r"kubectl patch -f examples/digits-train\.yaml .*?-p '([^']+)'", QUICK_START,
                                 re.S).group(1))
    job = merge_patched(yaml.safe_load((ROOT / "examples" / "digits-train.yaml").read_text()), patch)
    parsed = parse(job)
    assert parsed.spec.checkpoint.persistent_volume_claim == claim["metadata"]["name"]
    pool = parse(yaml.safe_load((ROOT / "examples" / "digits-pool.yaml").read_text()))
    assert pool.spec.model.from_training_job.name == parsed.metadata.name


def test_every_kubectl_get_sample_has_the_crds_columns():
    """Those kubectl prints without `-o wide`: the columns of priority 0."""
    samples = [line.split() for line in README.splitlines() if line.startswith("    NAME ")]
    columns = {kind: ["NAME", *(c["name"].upper() for c in crd_version(kind)["additionalPrinterColumns"]
                                if not c.get("priority"))] for kind in CRDS}
    assert len(samples) >= 4
    for header in samples:
        assert header in columns.values(), header


# --- the DL4J and Kubeflow tables ------------------------------------------------------------------------------

def tables(text: str) -> list[list[list[str]]]:
    """Each Markdown table: its rows (header first, the |---| line left out), each a list of cells."""
    found, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            if not set(line) <= set("|-: "):
                current.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif current:
            found.append(current)
            current = []
    return found


MAPPING_TABLES = tables(MAPPING)


def schema_at(kind: str, path: str) -> dict[str, Any]:
    """The structural schema of `path` (spec.x.y or status.x.y) in the kind's CRD; a KeyError names a wrong part."""
    node = crd_version(kind)["schema"]["openAPIV3Schema"]
    for part in path.split("."):
        while node.get("type") == "array":
            node = node["items"]
        if part in node.get("properties", {}):
            node = node["properties"][part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            raise KeyError(f"{kind} has no {path}: no {part!r} where {sorted(node.get('properties', {}))} are")
    return node


def test_the_mapping_section_has_its_three_tables():
    headers = [table[0] for table in MAPPING_TABLES]
    assert headers == [["DL4J", "ParallelTrainingJob", "`tandem.ParallelWrapper`"],
                       ["DL4J", "InferencePool", "`tandem.ParallelInference`"],
                       ["PyTorchJob", "ParallelTrainingJob"]]


@pytest.mark.parametrize("table", MAPPING_TABLES, ids=lambda table: table[0][1])
def test_every_tandem_field_the_mapping_names_exists(table):
    kind = table[0][1]
    paths = 0
    for row in table[1:]:
        for span in re.findall(r"`([^`]+)`", row[1]):
            match = re.fullmatch(r"((?:spec|status)(?:\.[A-Za-z]+)+)(?:: (\w+))?", span)
            if match is None:
                continue
            node = schema_at(kind, match.group(1))
            if match.group(2) and "enum" in node:
                assert match.group(2) in node["enum"], (span, node["enum"])
            paths += 1
    assert paths >= 10


@pytest.mark.parametrize(("column", "cls"), [(0, ParallelWrapper), (1, ParallelInference)])
def test_every_python_argument_and_method_the_mapping_names_exists(column, cls):
    table = MAPPING_TABLES[column]
    assert table[0][2] == f"`tandem.{cls.__name__}`"
    trainer_fields = set(TrainerSpec.model_fields) if cls is ParallelWrapper else set()  # its **trainer_options
    checked = 0
    for row in table[1:]:
        for span in re.findall(r"`([^`]+)`", row[2]):
            if match := re.fullmatch(r"(\w+)=.*", span):
                accepted = set(inspect.signature(cls.__init__).parameters) | trainer_fields
                assert match.group(1) in accepted, span
                if match.group(1) == "mode" and cls is ParallelWrapper:
                    assert json.loads(span.split("=", 1)[1]) in get_args(TrainingMode), span
            elif match := re.fullmatch(r"(\w+)\((.*)\)", span):
                name, arguments = match.groups()
                called = cls if name == cls.__name__ else getattr(cls, name)
                parameters = inspect.signature(called).parameters
                for argument in re.findall(r"(\w+)=", arguments):
                    assert argument in parameters, span
            elif not keyword.iskeyword(span):  # `with` is Python's
                assert hasattr(inference, span), span  # an error class: tandem.worker.serve.inference's
            checked += 1
    assert checked >= 8


# --- troubleshooting: the messages, made by the code that writes them ------------------------------------------

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
SETTINGS = Settings(worker_image="tandem-worker:0.1.0", restart_backoff_seconds=10)
CHECKPOINTS = "/var/lib/tandem/checkpoints/runs/digits-train/checkpoints"
TRACEBACK = "Traceback (most recent call last):\n" + '  File "trainer.py", line 1, in train\n    step()\n' * 30
"""A rank's log before its last line: longer than the 600 characters the operator keeps."""


def ago(seconds: float) -> str:
    return (NOW - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def digits_job(phase: str = "Running", restarts: int = 0, heartbeat: float = 2, claim: bool = True) -> dict[str, Any]:
    """The digits example on a cluster, its group running for 500 s."""
    document = yaml.safe_load((ROOT / "examples" / "digits-train.yaml").read_text())
    if claim:
        document["spec"]["checkpoint"]["persistentVolumeClaim"] = "digits-checkpoints"
    document["metadata"].update(namespace="default", uid="uid-1", generation=1)
    document["status"] = {
        "phase": phase, "restarts": restarts, "startTime": ago(600), "progress": {"lastHeartbeat": ago(heartbeat)},
        "conditions": [{"type": "Running", "status": "True", "reason": "Running", "message": "",
                        "lastTransitionTime": ago(500)}]}
    return document


def rank_pod(rank: int, phase: str = "Running", **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": f"digits-train-worker-{rank}", "labels": {RANK_LABEL: str(rank), GROUP_LABEL: "0"}},
            "status": {"phase": phase, "conditions": [{"type": "Ready", "status": str(phase == "Running")}], **status}}


def failed_rank(rank: int, code: int, reason: str, log: str) -> dict[str, Any]:
    return rank_pod(rank, "Failed", containerStatuses=[{"name": "worker", "state": {"terminated": {
        "exitCode": code, "reason": reason, "message": log, "finishedAt": ago(1)}}}])


def job_message(job: dict[str, Any], pods: list[dict[str, Any]]) -> str:
    return reconcile(read_resource(job), pods, None, NOW, SETTINGS).status["message"]


def rank_failed(last_line: str, *, rank: int = 0, code: int = 1, reason: str = "Error", restarts: int = 0) -> str:
    """The job's message when `rank` exits with `code`, its log ending in `last_line` (the other rank running)."""
    pods = [rank_pod(0), rank_pod(1)]
    pods[rank] = failed_rank(rank, code, reason, f"{TRACEBACK}{last_line}\n")
    return job_message(digits_job(restarts=restarts), pods)


def raised(error: BaseException) -> str:
    """The last line of a traceback for `error`."""
    return f"{type(error).__module__}.{type(error).__qualname__}: {error}"


def shown(message: str) -> bool:
    """The troubleshooting section shows `message` in a code block, where `…` may stand for one stretch of it."""
    blocks = re.findall(r"(?:^    .*\n)+", TROUBLESHOOTING, re.M)
    for block in ("\n".join(line[4:] for line in block.rstrip("\n").split("\n")) for block in blocks):
        before, ellipsis, after = block.partition("…")
        if block == message or (ellipsis and message.startswith(before) and message.endswith(after)
                                and len(message) >= len(before) + len(after)):
            return True
    return False


@pytest.fixture
def no_cuda(monkeypatch):
    """A worker image whose torch is the CUDA 13 build, on a node where CUDA does not work."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    monkeypatch.setattr(torch.version, "cuda", "13.0")


def test_a_gpu_rank_without_cuda_warns_and_with_require_gpu_fails_the_job(no_cuda, capsys):
    process_group.select_device(SimpleNamespace(local_rank=0), gpus=1, require_gpu=False)
    assert shown(capsys.readouterr().err.strip())
    with pytest.raises(Exception) as error:
        process_group.select_device(SimpleNamespace(local_rank=0), gpus=1, require_gpu=True)
    assert shown(rank_failed(raised(error.value)))
    assert shown(rank_failed(raised(error.value), restarts=3))


def test_require_gpu_is_refused_without_gpus_and_checked_by_tandem_run(no_cuda, tmp_path):
    crd_rules = [rule["message"] for rule in crd_version("ParallelTrainingJob")["schema"]["openAPIV3Schema"]
                 ["properties"]["spec"]["x-kubernetes-validations"]]
    assert any(rule.startswith("trainer.requireGPU") and flat(rule) in flat(TROUBLESHOOTING) for rule in crd_rules)
    document = yaml.safe_load((ROOT / "examples" / "digits-train.yaml").read_text())
    document["spec"].update(gpusPerWorker=1, checkpoint={"directory": str(tmp_path)})
    document["spec"]["trainer"]["requireGPU"] = True
    with pytest.raises(PreflightError) as error:
        preflight(parse(document))
    assert flat(str(error.value)) in flat(TROUBLESHOOTING)


def test_an_unschedulable_rank_keeps_the_job_pending_with_the_schedulers_reason():
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}
    pods = [rank_pod(rank, "Pending", conditions=[unschedulable]) for rank in (0, 1)]
    message = job_message(digits_job(phase="Pending"), pods)
    assert flat(message) in flat(TROUBLESHOOTING)


def test_a_call_the_api_refuses():
    refused = Refused("create", "Pod", "default/digits-train-worker-0", 403, "Forbidden",
                      'pods "digits-train-worker-0" is forbidden: User "system:serviceaccount:tandem-system:tandem" '
                      'cannot create resource "pods" in API group "" in the namespace "default"')
    assert shown(describe_refusal(refused))


def test_out_of_memory():
    assert shown(rank_failed("step 120/230  loss 0.1874  1840 samples/s", rank=1, code=137, reason="OOMKilled"))


def test_nan_steps_past_the_limit():
    record = StepRecord(SimpleNamespace(bad_steps=0, consecutive_bad_steps=0), max_consecutive_bad_steps=10,
                        counts_bad_steps=True)
    for step in range(48, 58):
        record.add(step, torch.tensor(float("nan")), torch.tensor(1.0))
    with pytest.raises(Exception) as error:
        record.flush()
    assert shown(rank_failed(raised(error.value)))


def test_a_checkpoint_that_does_not_fit_the_resumed_job():
    with pytest.raises(checkpoint.CheckpointError) as error:
        checkpoint.restore_model(mlp(hidden=256), mlp(hidden=128).state_dict(), f"{CHECKPOINTS}/step-00000230.pt")
    assert shown(rank_failed(raised(error.value)))
    for fragment, source in (("optimizer state does not fit this job (", "worker/train/state.py"),
                             ("truncated or corrupt checkpoint (", "worker/checkpoint.py"),
                             (". Remove it, or start afresh with spec.checkpoint.resume: false and ",
                              "tandem/backends/local.py")):
        assert fragment in (ROOT / source).read_text() and flat(fragment) in flat(TROUBLESHOOTING), fragment


def test_checkpoints_on_an_empty_dir_are_said_not_durable_and_cannot_be_served():
    job = digits_job(phase="Pending", claim=False)
    del job["status"]
    plan = reconcile(read_resource(job), [], None, NOW, SETTINGS)
    (durable,) = [c for c in plan.status["conditions"] if c["type"] == "CheckpointsDurable"]
    assert durable["status"] == "False" and flat(durable["message"]) in flat(TROUBLESHOOTING)
    pool = InferencePool.model_validate(yaml.safe_load((ROOT / "examples" / "digits-pool.yaml").read_text()))
    _, missing = pools._model_job(pool, job)
    assert flat(missing) in flat(TROUBLESHOOTING)


def test_a_hung_group_and_ranks_that_never_meet(monkeypatch):
    assert shown(job_message(digits_job(heartbeat=400), [rank_pod(0), rank_pod(1)]))
    clock = itertools.chain([0.0], itertools.repeat(1e9))  # the 300 s pass at once
    with monkeypatch.context() as patch:
        patch.setattr(time, "monotonic", lambda: next(clock))
        with pytest.raises(Exception) as error:
            process_group.wait_for_master(master_address("digits-train"), MASTER_PORT, 300.0)
    assert shown(raised(error.value))
