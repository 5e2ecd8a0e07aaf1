"""`POST /v2/repository/models/{m}/load` on a real server, as the pool's spec.modelRepository allows it: 403 while
loads are off or for a path outside the repository root (after `..` and symlinks), 400 naming what is wrong with a
file that is not a Tandem checkpoint of the served model, and after every refusal the old model still answers.
Also what `GET /v2/models/{m}` says is served, and `tandem serve` refusing a file that is not a checkpoint."""

from __future__ import annotations

import json
import pickle
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import orjson
import pytest
import torch
import tritonclient.http as triton
from inference_models import seeded_mlp
from serving import (
    ROOT,
    WAIT_S,
    Servers,
    infer,
    inputs,
    make_pool,
    reference,
    request,
    serve_process,
    write_checkpoint,
)

from tandem.worker import checkpoint

LOAD = "/v2/repository/models/digits/load"


def load_body(path: str | Path) -> bytes:
    return orjson.dumps({"parameters": {"checkpoint": str(path)}})


class Payload:
    """A pickled object whose unpickling would create `marker`: it must never run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def manifest(**fields) -> dict:
    return checkpoint.build_manifest(model="tandem.examples.digits:mlp", model_args={"hidden": 16},
                                     input_shape=[64], input_dtype="FP32", step=99, **fields)


def elsewhere(repo: Path) -> Path:
    """A valid checkpoint beside the repository root, not under it."""
    return write_checkpoint(repo.parent / "elsewhere", seed=3, step=7)


def symlink(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


def written(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def saved(path: Path, state) -> Path:
    torch.save(state, path)
    return path


def truncated(repo: Path) -> Path:
    whole = write_checkpoint(repo / "whole", seed=2, step=5).read_bytes()
    return written(repo / "truncated.pt", whole[:len(whole) // 2])


def empty_directory(repo: Path) -> Path:
    (repo / "empty").mkdir()
    return repo / "empty"


class Case(NamedTuple):
    name: str
    body: Callable[[Path], bytes]  # given the repository root: the load request's body (making its files)
    status: int
    words: str  # in the error; {root} is the repository root, {parent} its parent directory


def refused(name: str, setup: Callable[[Path], str | Path], status: int, words: str) -> Case:
    return Case(name, lambda repo: load_body(setup(repo)), status, words)


OUTSIDE = "is outside the model repository root {root}"
NOT_ZIP = "not a Tandem checkpoint: not a zip archive as torch.save writes"

REFUSED = [
    refused("a system file", lambda repo: "/etc/passwd", 403, f"/etc/passwd {OUTSIDE}"),
    refused("a .. escape", lambda repo: f"{repo}/../elsewhere/{elsewhere(repo).name}", 403,
            f"{{root}}/../elsewhere/step-00000007.pt (it resolves to {{parent}}/elsewhere/step-00000007.pt) {OUTSIDE}"),
    refused("a symlink out of the root", lambda repo: symlink(repo / "link.pt", elsewhere(repo)), 403, OUTSIDE),
    refused("a symlinked directory out of the root", lambda repo: symlink(repo / "linked", elsewhere(repo).parent),
            403, OUTSIDE),
    refused("a relative path", lambda repo: "step-00000001.pt", 403, OUTSIDE),
    refused("a text file", lambda repo: written(repo / "notes.txt", b"root:x:0:0:root:/root:/bin/bash\n"), 400,
            NOT_ZIP),
    refused("random bytes", lambda repo: written(repo / "random.pt", np.random.default_rng(0).bytes(4096)), 400,
            NOT_ZIP),
    refused("a plain pickle", lambda repo: written(repo / "plain.pkl", pickle.dumps({"model": 1})), 400, NOT_ZIP),
    refused("a truncated checkpoint", truncated, 400, "truncated or corrupt checkpoint"),
    refused("a pickled object", lambda repo: saved(repo / "object.pt", {
        "format": checkpoint.FORMAT, "manifest": manifest(), "model": Payload(repo / "unpickled")}), 400,
        "holds pickled objects, not only tensors and plain values"),
    refused("a bare state_dict", lambda repo: saved(repo / "bare.pt", seeded_mlp(2).state_dict()), 400,
            "not a Tandem checkpoint (format None"),
    refused("no model state", lambda repo: saved(repo / "no-model.pt", {
        "format": checkpoint.FORMAT, "manifest": manifest()}), 400, "incomplete checkpoint: no 'model' entry"),
    refused("weights of another architecture", lambda repo: saved(repo / "other.pt", {
        "format": checkpoint.FORMAT, "manifest": manifest(), "model": seeded_mlp(2, hidden=8).state_dict()}), 400,
        "checkpoint does not fit the model: shape mismatch 0.bias (8,) vs model (16,)"),
    refused("another model's code", lambda repo: saved(repo / "code.pt", {
        "format": checkpoint.FORMAT, "manifest": {**manifest(), "model": "os:getcwd"},
        "model": seeded_mlp(2).state_dict()}), 400,
        "the checkpoint's model is os:getcwd, but this server serves tandem.examples.digits:mlp"),
    refused("a checkpoint of another model's code", lambda repo: write_checkpoint(repo / "other", seed=1, step=1,
                                                                                 features=32), 400,
            "the checkpoint's model is torch.nn:Linear, but this server serves tandem.examples.digits:mlp"),
    refused("a damaged manifest", lambda repo: saved(repo / "manifest.pt", {
        "format": checkpoint.FORMAT, "manifest": {**manifest(), "input_shape": "64"},
        "model": seeded_mlp(2).state_dict()}), 400, "the checkpoint's input_shape '64' is not a list"),
    refused("a missing file", lambda repo: repo / "missing.pt", 400, "no such checkpoint file"),
    refused("a directory without checkpoints", empty_directory, 400, "no checkpoint in this directory"),
    Case("malformed JSON", lambda repo: b"{nope", 400, "malformed JSON in the load request"),
    Case("an unknown parameter", lambda repo: b'{"parameters": {"path": "x"}}', 400, "unknown load parameter(s) path"),
]


class Repository(NamedTuple):
    root: Path
    good: Path
    server: Any


@pytest.fixture(scope="module")
def loading_server(tmp_path_factory):
    """A server of `root/good/...` with loads on and no root set (the served checkpoint's directory is the root),
    for every refused load (each a case of its own; none changes what the server serves)."""
    root = tmp_path_factory.mktemp("models") / "digits"
    good = write_checkpoint(root, seed=1, step=1)
    with Servers() as servers:
        yield Repository(root, good, servers(make_pool(model={"checkpoint": str(good)},
                                                       modelRepository={"load": True})))


def test_load_requests_are_refused_unless_enabled(served, tmp_path):
    good = write_checkpoint(tmp_path / "models" / "digits", seed=1, step=1)
    disabled = served(make_pool(model={"checkpoint": str(good)}))
    status, _, body = request(disabled.port, "POST", LOAD, load_body(good))
    assert (status, json.loads(body)) == (403, {"error": "model repository loads are disabled: set "
                                                         "spec.modelRepository.load: true in the InferencePool"})
    assert request(disabled.port, "POST", LOAD, b"")[0] == 403  # a reload too


@pytest.mark.parametrize("case", REFUSED, ids=[case.name for case in REFUSED])
def test_a_load_outside_the_root_or_of_no_checkpoint_is_refused_and_the_model_kept(loading_server, case):
    repo, good, server = loading_server
    x = inputs(2)
    status, _, body = request(server.port, "POST", LOAD, case.body(repo))
    error = json.loads(body)["error"]
    words = case.words.format(root=repo, parent=repo.parent)
    assert (status, words in error) == (case.status, True), (case.name, status, error)
    if status == 400 and "JSON" not in case.words and "parameter" not in case.words:
        assert f"still serving {good}" in error, (case.name, error)
    client = triton.InferenceServerClient(server.url)
    np.testing.assert_allclose(infer(client, x), reference(x, seed=1), rtol=1e-5, atol=1e-6, err_msg=case.name)
    assert client.get_model_metadata("digits")["parameters"]["checkpoint"] == str(good)
    assert not (repo / "unpickled").exists()
    client.close()


def test_loads_under_the_root_swap_the_model(served, tmp_path):
    """Good loads: a newer checkpoint under the root, a directory's latest, a reload of the pool's own."""
    repo = tmp_path / "models" / "digits"
    good = write_checkpoint(repo, seed=1, step=1)
    x = inputs(2)
    server = served(make_pool(model={"checkpoint": str(good)}, modelRepository={"load": True}))
    client = triton.InferenceServerClient(server.url)
    newer = write_checkpoint(repo / "newer", seed=2, step=2)
    status, _, body = request(server.port, "POST", LOAD, load_body(newer))
    assert (status, json.loads(body)["checkpoint"]) == (200, str(newer))
    assert client.get_model_metadata("digits")["parameters"]["checkpoint"] == str(newer)
    np.testing.assert_allclose(infer(client, x), reference(x, seed=2), rtol=1e-5, atol=1e-6)
    latest = write_checkpoint(repo / "newer", seed=5, step=9)  # a directory names its latest checkpoint
    client.load_model("digits", config=json.dumps({"checkpoint": str(repo / "newer")}))  # tritonclient's call
    assert client.get_model_metadata("digits")["parameters"]["checkpoint"] == str(latest)
    np.testing.assert_allclose(infer(client, x), reference(x, seed=5), rtol=1e-5, atol=1e-6)
    status, _, body = request(server.port, "POST", LOAD, b"")  # no checkpoint: reload the pool's own
    assert (status, json.loads(body)["checkpoint"]) == (200, str(good))
    client.close()


def test_a_swap_keeps_the_served_models_inputs_and_outputs(served, tmp_path):
    """The same code (torch.nn:Linear) with other arguments may be swapped in, but not with other outputs."""
    repo = tmp_path / "linear"
    first = write_checkpoint(repo, seed=1, step=1, features=32)  # Linear(32, 10)
    server = served(make_pool(model={"checkpoint": str(first)}, modelRepository={"load": True}))
    fewer = saved(repo / "fewer-classes.pt", {"format": checkpoint.FORMAT, "manifest": checkpoint.build_manifest(
        model="torch.nn:Linear", model_args={"in_features": 32, "out_features": 5}, input_shape=[32],
        input_dtype="FP32", step=2), "model": torch.nn.Linear(32, 5).state_dict()})
    status, _, body = request(server.port, "POST", LOAD, load_body(fewer))
    assert status == 400 and "a hot swap must keep them" in json.loads(body)["error"], body


def test_a_callable_loads_checkpoints_only_under_a_configured_root(served, tmp_path):
    x = inputs(2)
    no_root = served(make_pool("plain", modelRepository={"load": True}))
    status, _, body = request(no_root.port, "POST", "/v2/repository/models/plain/load",
                              load_body(write_checkpoint(tmp_path, seed=2, step=2)))
    assert status == 403 and "set spec.modelRepository.root in the InferencePool" in json.loads(body)["error"]
    assert request(no_root.port, "POST", "/v2/repository/models/plain/load", b"")[0] == 200  # a reload is allowed
    rooted = served(make_pool("rooted", model={"callable": "tandem.examples.digits:mlp", "args": {"hidden": 16},
                                               "inputShape": [64]},
                              modelRepository={"load": True, "root": str(tmp_path / "repo")}))
    status, _, body = request(rooted.port, "POST", "/v2/repository/models/rooted/load",
                              load_body(write_checkpoint(tmp_path / "repo", seed=4, step=4)))
    assert status == 200 and json.loads(body)["source"] == "callable"
    np.testing.assert_allclose(infer(triton.InferenceServerClient(rooted.url), x, model="rooted"),
                               reference(x, seed=4), rtol=1e-5, atol=1e-6)


def test_model_metadata_parameters_say_which_checkpoint_is_served_from_which_source_since_when(served, tmp_path):
    before = datetime.now(UTC).replace(microsecond=0)
    good = write_checkpoint(tmp_path, seed=1, step=1)
    servers = {"checkpoint": served(make_pool(model={"checkpoint": str(good)})), "callable": served(make_pool())}
    after = datetime.now(UTC)
    for source, server in servers.items():
        metadata = triton.InferenceServerClient(server.url).get_model_metadata("digits", "1")  # tritonclient parses it
        assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
        parameters = metadata["parameters"]
        assert set(parameters) == {"checkpoint", "source", "loaded_at", "batch_limit", "queue_limit",
                                    "max_queue_delay_microseconds", "request_timeout_ms"}  # and what it batches by
        assert parameters["batch_limit"] == make_pool().spec.batch_limit
        assert (parameters["checkpoint"], parameters["source"]) == (str(good) if source == "checkpoint" else None,
                                                                     source)
        assert parameters["loaded_at"].endswith("Z")
        loaded_at = datetime.strptime(parameters["loaded_at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        assert before <= loaded_at <= after + timedelta(seconds=1), (parameters, before, after)


def test_tandem_serve_refuses_a_file_that_is_not_a_checkpoint_in_one_line_and_exits_1():
    """One line naming the file, exit 1, and no `listening on` line: that comes once the model is loaded."""
    process = serve_process(ROOT / "examples" / "digits-pool.yaml", "--checkpoint", "/etc/passwd")
    try:
        _, log = process.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 1, log
    assert "Traceback" not in log and "listening" not in log, log
    errors = [line for line in log.splitlines() if "/etc/passwd" in line]
    assert errors == ["tandem serve: cannot serve model 'digits': /etc/passwd: not a Tandem checkpoint: not a zip "
                      "archive as torch.save writes (another kind of file, or a truncated or corrupt checkpoint)"], log
