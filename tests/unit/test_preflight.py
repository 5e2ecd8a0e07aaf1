"""Fail fast, and once (issue 36): the pre-flight check's pure functions (worker/train/preflight.py,
worker/train/invalid.py), the report a rank ends with on a permanent failure (InvalidModelOrData, or
CheckpointDirectoryTaken: worker/checkpoint_owner.py) and how `tandem run`'s policy and the operator read it
(tandem/contract.py, tandem/restart_policy.py, operator/training.py). Table-driven: (name, input, expected)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tandem.api.training import TrainerSpec
from tandem.contract import (
    PERMANENT_FAILURE_EXIT_CODE,
    PermanentFailure,
    PermanentFailureReport,
    permanent_failure_report,
)
from tandem.examples.digits import cnn, mlp
from tandem.operator.observed import read_resource
from tandem.operator.training import Settings, reconcile
from tandem.restart_policy import after_failure
from tandem.worker.checkpoint_owner import OwnershipError
from tandem.worker.train.invalid import (
    InvalidModelOrData,
    custom_command_problem,
    library_file,
    module_path,
    python_target,
    report,
)
from tandem.worker.train.preflight import (
    FirstLayer,
    check_fit,
    data_elsewhere,
    first_layer,
    input_problem,
    load_inputs,
    target_problem,
)

LINEAR_64 = FirstLayer("0", "Linear", 64)
CONV2D_1 = FirstLayer("0", "Conv2d", 1, spatial_dims=2)
CONV2D_3 = FirstLayer("conv", "Conv2d", 3, spatial_dims=2)
EMBEDDING = FirstLayer("embed", "Embedding", 1000, takes_indices=True)


@pytest.mark.parametrize(("example_shape", "dtype", "layer", "expected"), [
    ((64,), torch.float32, LINEAR_64, None),
    ((32,), torch.float32, LINEAR_64,
     "data has 32 features, the model expects 64 (its first layer, 0: Linear): give the model 32 inputs "
     "(spec.trainer.modelArgs) or data with 64 features"),
    ((8, 8), torch.float32, LINEAR_64, "data examples have shape (8, 8), the model expects 64 features"),
    ((64,), torch.int64, LINEAR_64, "data x is int64, the model's weights are float32: store x as float32"),
    ((), torch.float32, FirstLayer("0", "Linear", 1), None),
    ((1, 8, 8), torch.float32, CONV2D_1, None),
    ((8, 8), torch.float32, CONV2D_1, "add the channel axis (x[:, None])"),
    ((64,), torch.float32, CONV2D_3, "data examples have 1 dimensions (64,), the model's its first layer"),
    ((1, 8, 8), torch.float32, CONV2D_3, "data has 1 channels, the model expects 3 (its first layer, conv: Conv2d)"),
    ((16,), torch.int64, EMBEDDING, None),
    ((16,), torch.float32, EMBEDDING, "data x is float32, the model's its first layer, embed: Embedding takes integer"),
], ids=["linear-fits", "linear-features", "linear-unflattened", "linear-integers", "linear-scalar", "conv-fits",
        "conv-no-channel-axis", "conv-flat", "conv-channels", "embedding-fits", "embedding-floats"])
def test_input_problem(example_shape, dtype, layer, expected):
    problem = input_problem(example_shape, dtype, layer)
    assert problem == expected if expected is None else expected in problem, problem


@pytest.mark.parametrize(("output_shape", "targets", "expected"), [
    ((10,), torch.tensor([0, 9, 3]), None),
    ((10,), torch.tensor([0, 10, 3]),
     "data y holds class 10, the model outputs 10 classes (0 to 9): give the model 11 outputs, or number the classes "
     "from 0"),
    ((10,), torch.tensor([-1, 2]), "data y holds class -1"),
    ((10,), torch.tensor([-100, 2]), None),
    ((10,), torch.tensor([[1, 2]]), "data y has shape (2,) per example, and the model outputs (10,)"),
    ((10,), torch.tensor([0.0, 1.0]), "data y has 1 value(s) per example, the model outputs 10: for class labels store "
                                      "y as integers"),
    ((1,), torch.tensor([0.5, 1.5]), None),
    ((3,), torch.ones(2, 3), None),
    ((10,), torch.tensor([True, False]), "data y is bool"),
], ids=["classes-fit", "class-out-of-range", "negative-class", "ignored-label", "label-shape", "float-labels",
        "regression-fits", "regression-vector-fits", "bool-labels"])
def test_target_problem(output_shape, targets, expected):
    problem = target_problem(output_shape, targets)
    assert problem == expected if expected is None else expected in problem, problem


class HeadFirst(nn.Module):
    """Defines its head before its body: the order of definition is not the order of application."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 10)
        self.body = nn.Linear(64, 16)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize(("model", "expected"), [
    (mlp(), FirstLayer("0", "Linear", 64)),
    (cnn(), FirstLayer("0", "Conv2d", 1, spatial_dims=2)),
    (nn.Sequential(nn.Embedding(100, 8), nn.Flatten(), nn.Linear(8, 2)), FirstLayer("0", "Embedding", 100,
                                                                                  takes_indices=True)),
    (nn.Sequential(nn.LazyLinear(10)), None),
    (nn.Sequential(nn.ReLU()), None),
], ids=["mlp", "cnn", "embedding", "lazy", "no-weights"])
def test_first_layer(model, expected):
    assert first_layer(model) == expected


def digits_like(features: int, classes: int = 10, examples: int = 8) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(examples, features, generator=generator),
                         torch.randint(0, classes, (examples,), generator=generator))


@pytest.mark.parametrize(("model", "train_set", "eval_set", "expected"), [
    (mlp(), digits_like(64), digits_like(64), None),
    (mlp(), digits_like(32), None, "spec.trainer.data: data has 32 features, the model expects 64"),
    (mlp(), digits_like(64), digits_like(32), "spec.trainer.evalData: data has 32 features, the model expects 64"),
    (mlp(), digits_like(64, classes=12, examples=64), None, "spec.trainer.data: data y holds class 11"),
    (HeadFirst(), digits_like(64), None, None),
    (nn.Sequential(nn.Linear(64, 10), nn.Dropout(0.5), nn.BatchNorm1d(10)), digits_like(64), None, None),
    (nn.Sequential(nn.Flatten(0)), digits_like(64), None, "the model outputs ()"),
], ids=["fits", "features", "eval-features", "classes", "head-defined-first", "dropout-batchnorm", "scalar-output"])
def test_check_fit(model, train_set, eval_set, expected):
    if expected is None:
        check_fit(model, train_set, eval_set)
        return
    with pytest.raises(InvalidModelOrData) as error:
        check_fit(model, train_set, eval_set)
    assert expected in str(error.value)


def test_the_check_changes_neither_the_model_nor_the_random_generators():
    model = nn.Sequential(nn.Linear(64, 10), nn.Dropout(0.5), nn.BatchNorm1d(10))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    torch.manual_seed(7)
    expected_draw = torch.rand(3)
    torch.manual_seed(7)
    check_fit(model, digits_like(64), None)
    assert torch.equal(torch.rand(3), expected_draw)
    assert model.training
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert all(parameter.grad is None for parameter in model.parameters())


@pytest.mark.parametrize(("arrays", "expected"), [
    ({"features": np.zeros((4, 64), np.float32), "y": np.zeros(4, np.int64)},
     "a data file needs arrays x and y; missing ['x'] (it holds ['features', 'y']): save the examples as x and their "
     "labels or targets as y, numpy.savez(path, x=..., y=...)"),
    ({"x": np.zeros((4, 64), np.float32)}, "missing ['y'] (it holds ['x'])"),
    ({"x": np.zeros((4, 32), np.float32), "y": np.zeros(4, np.int64)}, "data has 32 features, the model expects 64"),
    ({"x": np.zeros((0, 64), np.float32), "y": np.zeros(0, np.int64)}, "holds no examples"),
], ids=["missing-x", "missing-y", "features", "empty"])
def test_a_data_file_that_does_not_fit_is_named(tmp_path, arrays, expected):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    trainer = TrainerSpec(model="tandem.examples.digits:mlp", data=str(path))
    with pytest.raises(InvalidModelOrData) as error:
        check_fit(*load_inputs(trainer))
    assert str(error.value).startswith("spec.trainer.data: ") and expected in str(error.value), str(error.value)


@pytest.mark.parametrize(("model", "expected"), [
    ("tandem.examples.digit:mlp", "spec.trainer.model: cannot import module 'tandem.examples.digit' of "
                                  "'tandem.examples.digit:mlp': ModuleNotFoundError"),
    ("tandem.examples.digits:nope", "spec.trainer.model: 'tandem.examples.digits:nope': module "
                                    "'tandem.examples.digits' has no attribute 'nope'"),
], ids=["module", "attribute"])
def test_a_bad_model_reference_is_named(model, expected):
    with pytest.raises(InvalidModelOrData) as error:
        load_inputs(TrainerSpec(model=model, data="tandem.examples.digits:train_data"))
    assert str(error.value).startswith(expected), str(error.value)


@pytest.mark.parametrize(("model", "hint"), [
    ("tandem.examples.digit:mlp", "; did you mean 'tandem.examples.digits'?"),
    ("tandem.examples.digits:mpl", "; did you mean 'mlp'?"),
    ("tandem.examples.digits:train", "; did you mean 'train_data'?"),
    ("tandem.examples.digits:np", ""),
    ("tandem.examples.digits:zzz", ""),
    ("no_such_package_here.models:net", ""),
], ids=["module", "attribute", "attribute-prefix", "imported-name", "nothing-close", "missing-parent"])
def test_a_mistyped_reference_suggests_the_closest_name(model, hint):
    with pytest.raises(InvalidModelOrData) as error:
        load_inputs(TrainerSpec(model=model, data="tandem.examples.digits:train_data"))
    assert str(error.value).endswith(hint) and ("did you mean" in str(error.value)) == bool(hint), str(error.value)


@pytest.mark.parametrize(("data", "eval_data", "expected"), [
    ("tandem.examples.digits:train_data", "tandem.examples.digits:eval_data", None),
    ("/nowhere/train.npz", None, "/nowhere/train.npz"),
    ("tandem.examples.digits:train_data", "company_datasets.images:eval", "company_datasets.images:eval"),
], ids=["here", "file-elsewhere", "module-elsewhere"])
def test_data_elsewhere(data, eval_data, expected):
    assert data_elsewhere(TrainerSpec(model="m:f", data=data, evalData=eval_data)) == expected


@pytest.mark.parametrize(("arguments", "expected"), [
    (["-m", "trainer.main", "--lr", "1"], ("module", "trainer.main")),
    (["-u", "-X", "dev", "train.py", "-m", "x"], ("script", "train.py")),
    (["-W", "ignore", "-m", "pkg"], ("module", "pkg")),
    (["-c", "print(1)"], (None, None)),
    ([], (None, None)),
], ids=["module", "script-after-options", "option-values", "code", "interactive"])
def test_python_target(arguments, expected):
    assert python_target(arguments) == expected


@pytest.mark.parametrize(("argv", "expected"), [
    (["trainer-bin", "--epochs", "3"], None),
    (["nope-not-installed"], "spec.custom.command: 'nope-not-installed' is not an executable on PATH"),
    (["python", "-m", "missing.module"], "spec.custom.command: python cannot import module 'missing.module' "
                                         "(`-m missing.module`)"),
    (["python3", "-m", "present.module"], None),
    (["python", "no_such_script.py"], "spec.custom.command: the Python script 'no_such_script.py' does not exist"),
    (["python", "-c", "import anything"], None),
], ids=["program", "not-on-path", "python-module-missing", "python-module-found", "script-missing", "code"])
def test_custom_command_problem(argv, expected):
    def which(program):
        return None if program.startswith("nope") else f"/usr/bin/{program}"

    def module_found(python, module):
        return module == "present.module"

    problem = custom_command_problem(argv, which=which, module_found=module_found)
    assert problem == expected if expected is None else problem.startswith(expected), problem


TAKEN = ("CheckpointDirectoryTaken: spec.checkpoint.directory /ck holds another run's checkpoints (run old of job "
         "long: step-00002860.pt (1 file)) and spec.checkpoint.resume is false")


@pytest.mark.parametrize(("output", "expected"), [
    ("Traceback ...\nValueError: x\nInvalidModelOrData: spec.trainer.data: data has 32 features\n"
     "  raised at a.py:1 in f",
     ("InvalidModelOrData", "InvalidModelOrData: spec.trainer.data: data has 32 features\n  raised at a.py:1 in f")),
    ("InvalidModelOrData: first\nInvalidModelOrData: second\n", ("InvalidModelOrData", "InvalidModelOrData: second")),
    (f"Traceback ...\ntandem.worker.checkpoint_owner.OwnershipError: ...\n{TAKEN}\n",
     ("CheckpointDirectoryTaken", TAKEN)),
    (f"InvalidModelOrData: first\n{TAKEN}", ("CheckpointDirectoryTaken", TAKEN)),
    (f"{TAKEN}\nInvalidModelOrData: second", ("InvalidModelOrData", "InvalidModelOrData: second")),
    ("Traceback ...\nOwnershipError: held\nRuntimeError: boom\n", None),
    ("InvalidModelOrData:no space\n", None),
    ("Traceback ...\nRuntimeError: boom\n", None),
    ("", None),
], ids=["after-a-traceback", "the-last-one", "directory-taken", "the-last-of-two-reasons", "the-last-of-two-reasons-2",
        "another-exception", "not-a-report-line", "none", "empty"])
def test_permanent_failure_report(output, expected):
    found = permanent_failure_report(output)
    assert found == (PermanentFailureReport(*expected) if expected else None)


@pytest.mark.parametrize(("module", "filename", "expected"), [
    ("tandem.worker.user_code", "/site-packages/tandem/worker/user_code.py", "tandem/worker/user_code.py"),
    ("mypkg", "/src/mypkg/__init__.py", "mypkg/__init__.py"),
    ("__main__", "/home/me/train.py", "train.py"),
], ids=["module", "package", "script"])
def test_module_path(module, filename, expected):
    assert module_path(module, filename) == expected


STDLIB = "/usr/local/lib/python3.11"
TORCH = f"{STDLIB}/site-packages/torch"


@pytest.mark.parametrize(("filename", "expected"), [
    ("<frozen importlib._bootstrap>", True),
    (f"{STDLIB}/importlib/__init__.py", True),
    (f"{TORCH}/nn/modules/linear.py", True),
    (f"{STDLIB}/site-packages/tandem/worker/user_code.py", False),
    (f"{STDLIB}/site-packages/mymodels/net.py", False),
    ("/usr/lib/python3/dist-packages/mymodels/net.py", False),
    ("/home/me/train.py", False),
], ids=["frozen", "stdlib", "torch", "tandem-installed-beside-the-stdlib", "user-package", "debian-package", "script"])
def test_library_file(filename, expected):
    assert library_file(filename, stdlib=STDLIB, torch_dir=TORCH) is expected


def test_the_report_leads_with_the_exception_line_then_the_frame_that_raised_it():
    def user_forward():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x32 and 64x128)")

    try:
        try:
            user_forward()
        except RuntimeError as error:
            raise InvalidModelOrData("spec.trainer.data: data has 32 features, the model expects 64") from error
    except InvalidModelOrData as error:
        lines = report(error).splitlines()
    assert lines[0] == "InvalidModelOrData: spec.trainer.data: data has 32 features, the model expects 64"
    assert lines[1].startswith("  raised at ") and lines[1].endswith(
        'in user_forward: raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x32 and 64x128)")')
    assert len(lines) == 2


@pytest.mark.parametrize(("error", "expected"), [
    (InvalidModelOrData("spec.trainer.data: data has 32 features"),
     "InvalidModelOrData: spec.trainer.data: data has 32 features"),
    (OwnershipError("spec.checkpoint.directory /ck is in use by another run: held by pid 7 on host a"),
     "CheckpointDirectoryTaken: spec.checkpoint.directory /ck is in use by another run: held by pid 7 on host a"),
], ids=["invalid-with-its-frame", "taken-its-message-alone"])
def test_the_report_of_a_permanent_failure_leads_with_its_reason(error, expected):
    try:
        raise error
    except PermanentFailure as raised:
        lines = report(raised).splitlines()
    assert lines[0] == expected
    assert [line.endswith(" in test_the_report_of_a_permanent_failure_leads_with_its_reason: raise error")
            for line in lines[1:]] == ([True] if error.names_its_frame else [])
    assert permanent_failure_report("\n".join(["Traceback ...", *lines])) == (error.reason, "\n".join(lines))


@pytest.mark.parametrize(("restarts_done", "backoff_limit", "permanent"), [
    (0, 3, PermanentFailureReport("InvalidModelOrData", "InvalidModelOrData: bad\n  raised at")),
    (2, 3, PermanentFailureReport("InvalidModelOrData", "InvalidModelOrData: bad\n  raised at")),
    (0, 0, PermanentFailureReport("InvalidModelOrData", "InvalidModelOrData: bad\n  raised at")),
    (0, 3, PermanentFailureReport("CheckpointDirectoryTaken", TAKEN)),
    (1, 3, PermanentFailureReport("CheckpointDirectoryTaken", TAKEN)),
], ids=["invalid-first-attempt", "invalid-after-restarts", "invalid-no-restarts-allowed", "taken-first-attempt",
        "taken-after-a-restart"])
def test_a_permanent_failure_fails_at_once_spending_no_restart(restarts_done, backoff_limit, permanent):
    decision = after_failure(restarts_done=restarts_done, backoff_limit=backoff_limit, base_seconds=10,
                             cause="rank 0 exited with code 78", permanent=permanent)
    assert (decision.action, decision.restarts, decision.reason) == ("fail", restarts_done, permanent.reason)
    assert decision.message.startswith(f"{permanent.report}\nrank 0 exited with code 78; not restarted: a restart "
                                       "would fail the same way")


NOW = datetime(2026, 12, 3, 12, 0, 0, tzinfo=UTC)
RANK_OUTPUT = ("Traceback (most recent call last):\n  ...\nRuntimeError: mat1 and mat2 shapes cannot be multiplied "
               "(2x32 and 64x128)\n\nThe above exception was the direct cause of the following exception:\n\n"
               "Traceback (most recent call last):\n  ...\n"
               "tandem.worker.train.invalid.InvalidModelOrData: spec.trainer.data: data has 32 features, the model "
               "expects 64\n"
               "InvalidModelOrData: spec.trainer.data: data has 32 features, the model expects 64\n"
               "  raised at tandem/worker/train/preflight.py:242 in _forward: outputs = model(inputs)\n")


def rank_pod(index: int, exit_code: int | None, message: str = "", ranks_per_pod: int = 1) -> dict:
    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    if exit_code is not None:
        status = {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False"}], "containerStatuses": [
            {"name": "worker", "state": {"terminated": {"exitCode": exit_code, "reason": "Error", "message": message,
                                                        "finishedAt": "2026-12-03T11:59:59Z"}}}]}
    labels = {"tandem.dev/job": "fit", "tandem.dev/rank": str(index * ranks_per_pod),
              "tandem.dev/pod-index": str(index), "tandem.dev/group": "0"}
    return {"metadata": {"name": f"fit-worker-{index}", "namespace": "ml", "labels": labels}, "status": status}


def fit_job(ranks_per_pod: int = 1) -> dict:
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "ParallelTrainingJob",
            "metadata": {"name": "fit", "namespace": "ml", "uid": "uid-1", "generation": 1},
            "spec": {"workers": 2 * ranks_per_pod, "ranksPerPod": ranks_per_pod, "backoffLimit": 3,
                     "trainer": {"model": "tandem.examples.digits:mlp", "data": "/data/narrow.npz"}},
            "status": {"phase": "Running", "restarts": 0, "startTime": "2026-12-03T11:59:00Z",
                       "conditions": [{"type": "Running", "status": "True", "reason": "Running", "message": "",
                                       "lastTransitionTime": "2026-12-03T11:59:30Z"}]}}


INVALID_REPORT = ["InvalidModelOrData: spec.trainer.data: data has 32 features, the model expects 64",
                  "  raised at tandem/worker/train/preflight.py:242 in _forward: outputs = model(inputs)"]
TAKEN_OUTPUT = ("Traceback (most recent call last):\n  ...\ntandem.worker.checkpoint_owner.OwnershipError: "
                f"{TAKEN.split(': ', 1)[1]}\n{TAKEN}\n")


@pytest.mark.parametrize(("ranks_per_pod", "message", "reason", "report", "cause"), [
    (1, RANK_OUTPUT, "InvalidModelOrData", INVALID_REPORT,
     "rank 0 (pod fit-worker-0) exited with code 78; not restarted"),
    (2, f"rank 0 (local rank 0) exited with code 78\n{RANK_OUTPUT}", "InvalidModelOrData", INVALID_REPORT,
     "rank 0 (pod fit-worker-0, local rank 0) exited with code 78; not restarted"),
    (1, TAKEN_OUTPUT, "CheckpointDirectoryTaken", [TAKEN],
     "rank 0 (pod fit-worker-0) exited with code 78; not restarted"),
    (2, f"rank 0 (local rank 0) exited with code 78\n{TAKEN_OUTPUT}", "CheckpointDirectoryTaken", [TAKEN],
     "rank 0 (pod fit-worker-0, local rank 0) exited with code 78; not restarted"),
], ids=["invalid-a-rank-per-pod", "invalid-several-ranks-per-pod", "taken-a-rank-per-pod",
        "taken-several-ranks-per-pod"])
def test_the_operator_fails_the_job_at_once_with_the_ranks_report(ranks_per_pod, message, reason, report, cause):
    pods = [rank_pod(0, PERMANENT_FAILURE_EXIT_CODE, message, ranks_per_pod), rank_pod(1, None, ranks_per_pod=2)]
    plan = reconcile(read_resource(fit_job(ranks_per_pod)), pods, None, NOW,
                     Settings(worker_image="tandem-worker:1", restart_backoff_seconds=10))
    assert (plan.status["phase"], plan.status["restarts"]) == ("Failed", 0)
    assert plan.status["message"].splitlines() == [
        *report, f"{cause}: a restart would fail the same way (fix the job's spec)"]
    assert next(c for c in plan.status["conditions"] if c["type"] == "Failed")["reason"] == reason
    assert plan.events[-1][:2] == ("Warning", reason)
    assert plan.delete_pods == ["fit-worker-1"]


def test_the_same_exit_without_a_report_is_an_ordinary_failure():
    pods = [rank_pod(0, PERMANENT_FAILURE_EXIT_CODE, "Traceback ...\nSystemExit: 78"), rank_pod(1, None)]
    plan = reconcile(read_resource(fit_job()), pods, None, NOW,
                     Settings(worker_image="tandem-worker:1", restart_backoff_seconds=10))
    assert (plan.status["phase"], plan.status["restarts"]) == ("Restarting", 1)


README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def readme_block(after: str) -> list[str]:
    """The indented lines of the README's example that follows the line ending with `after`."""
    block = README.split(after, 1)[1].lstrip("\n").split("\n\n", 1)[0]
    return [line.strip() for line in block.splitlines()]


def matches(shown: str, actual: str) -> bool:
    """`actual` is what the README shows, `…` standing for a line number."""
    return re.fullmatch(re.escape(shown.strip()).replace("…", r"\d+"), actual.strip()) is not None


def features_report() -> str:
    with pytest.raises(InvalidModelOrData) as error:
        check_fit(mlp(), digits_like(32), None)
    return report(error.value)


def test_the_readmes_tandem_run_example_is_what_the_check_reports():
    shown = readme_block("raised it:\n")
    actual = ["tandem run: Failed: " + line if index == 0 else line
              for index, line in enumerate(features_report().splitlines())]
    assert len(shown) == len(actual) == 2
    assert all(matches(*pair) for pair in zip(shown, actual, strict=True)), (shown, actual)


def test_the_readmes_troubleshooting_example_is_the_operators_message():
    troubleshooting = (Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md").read_text()  # the README's
    shown = [line.strip() for line in troubleshooting.split("then the frame that raised it:\n\n", 1)[1]
             .split("\n\n", 1)[0].splitlines()]
    output = f"Traceback (most recent call last):\n  ...\n{features_report()}\n"
    pod = rank_pod(0, PERMANENT_FAILURE_EXIT_CODE, output)
    pod["metadata"]["name"] = "digits-train-worker-0"
    body = fit_job()
    body["metadata"]["name"] = "digits-train"
    plan = reconcile(read_resource(body), [pod], None, NOW,
                     Settings(worker_image="tandem-worker:1", restart_backoff_seconds=10))
    actual = plan.status["message"].splitlines()
    assert len(shown) == len(actual) == 3
    assert all(matches(*pair) for pair in zip(shown, actual, strict=True)), (shown, actual)
