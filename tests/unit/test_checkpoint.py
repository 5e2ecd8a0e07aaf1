"""Checkpoint files, user references and the worker contract, without a process group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.examples.digits import mlp
from tandem.worker import checkpoint
from tandem.worker.user_code import BadReference, build_model, load_dataset


def _save(directory: Path, step: int, model: torch.nn.Module | None = None, keep_last: int = 3) -> Path:
    model = model or mlp(hidden=8)
    manifest = checkpoint.build_manifest(model="tandem.examples.digits:mlp", model_args={"hidden": 8},
                                         input_shape=[64], step=step)
    return checkpoint.save(directory, {"manifest": manifest, "model": model.state_dict()}, step=step,
                           keep_last=keep_last)


def test_save_is_complete_under_its_final_name_and_keeps_the_last_k(tmp_path):
    for step in (10, 20, 30, 40):
        _save(tmp_path, step, keep_last=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000030.pt", "step-00000040.pt"]
    assert checkpoint.latest(tmp_path).name == "step-00000040.pt"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    state = checkpoint.load(checkpoint.latest(tmp_path))
    assert state["manifest"]["step"] == 40
    assert {"tandem", "torch", "python"} <= state["manifest"].keys()


def test_load_for_inference_rebuilds_the_model_from_the_manifest(tmp_path):
    trained = mlp(hidden=8)
    path = _save(tmp_path, 5, trained)
    model, manifest = checkpoint.load_for_inference(path)
    assert not model.training and manifest["input_shape"] == [64]
    x = torch.rand(3, 64)
    assert torch.equal(model(x), trained.eval()(x))


def test_truncated_checkpoint_is_refused(tmp_path):
    path = _save(tmp_path, 1)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(checkpoint.CheckpointError, match="truncated or corrupt"):
        checkpoint.load(path)


def test_random_bytes_are_refused(tmp_path):
    path = tmp_path / "step-00000001.pt"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(checkpoint.CheckpointError, match="truncated or corrupt"):
        checkpoint.load(path)


class _Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_pickled_object_is_never_unpickled(tmp_path, capsys):
    path = tmp_path / "step-00000001.pt"
    torch.save({"format": checkpoint.FORMAT, "manifest": {}, "model": _Payload()}, path)
    with pytest.raises(checkpoint.CheckpointError, match="holds pickled objects"):
        checkpoint.load(path)
    assert "this must never run" not in capsys.readouterr().out


def test_a_foreign_file_is_not_a_tandem_checkpoint(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save(mlp(hidden=8).state_dict(), path)
    with pytest.raises(checkpoint.CheckpointError, match="not a Tandem checkpoint"):
        checkpoint.load(path)


def test_a_checkpoint_that_does_not_fit_the_model_names_what_differs(tmp_path):
    path = _save(tmp_path, 1, mlp(hidden=8))
    state = checkpoint.load(path)
    with pytest.raises(checkpoint.CheckpointError, match=r"shape mismatch .*0.weight \(8, 64\) vs model \(16, 64\)"):
        checkpoint.restore_model(mlp(hidden=16), state["model"], path)
    del state["model"]["4.bias"]
    with pytest.raises(checkpoint.CheckpointError, match="missing 4.bias"):
        checkpoint.restore_model(mlp(hidden=8), state["model"], path)


def test_missing_file(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no such checkpoint"):
        checkpoint.load(tmp_path / "nope.pt")


@pytest.mark.parametrize(("ref", "message"), [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("tandem.examples.digits:nothing", "has no attribute 'nothing'"),
    ("tandem.examples.digits:CLASSES", "names a int, not a callable"),
    ("tandem.examples.digits:train_data", "returned a TensorDataset, expected a Module"),
    ("missing-colon", "is not a `module:callable` reference"),
])
def test_bad_model_references_are_named(ref, message):
    with pytest.raises(BadReference, match=message) as caught:
        build_model(ref)
    assert ref in str(caught.value) or "module:callable" in str(caught.value)


def test_npz_data_files(tmp_path):
    good = tmp_path / "good.npz"
    np.savez(good, x=np.random.default_rng(0).random((10, 64)), y=np.arange(10) % 3)
    dataset = load_dataset(str(good))
    x, y = dataset[0]
    assert x.dtype == torch.float32 and x.shape == (64,) and y.dtype == torch.int64
    no_labels = tmp_path / "no_labels.npz"
    np.savez(no_labels, x=np.zeros((3, 2)))
    with pytest.raises(BadReference, match=r"needs arrays x and y; missing \['y'\]"):
        load_dataset(str(no_labels))
    uneven = tmp_path / "uneven.npz"
    np.savez(uneven, x=np.zeros((3, 2)), y=np.zeros(2))
    with pytest.raises(BadReference, match="x has 3 examples but y has 2"):
        load_dataset(str(uneven))
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, x=np.array([object()], dtype=object), y=np.zeros(1))
    with pytest.raises(BadReference, match="cannot read the data file"):
        load_dataset(str(pickled))
