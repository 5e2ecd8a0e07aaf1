"""scikit-learn's bundled 8x8 digits (1,797 images, no download) with a fixed train/eval split.

Reference these from a manifest: `model: tandem.examples.digits:mlp`, `data: tandem.examples.digits:train_data`,
`evalData: tandem.examples.digits:eval_data`.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

EVAL_FRACTION = 0.2
SPLIT_SEED = 0
FEATURES = 64
CLASSES = 10


def _digits_csv() -> Path:
    """scikit-learn's bundled copy of the data, found without importing scikit-learn (about 1.4 s per process:
    every rank of every run would pay it)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the digits example reads scikit-learn's bundled data: pip install scikit-learn")
    return Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"


@cache
def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    data = np.loadtxt(_digits_csv(), delimiter=",")  # what sklearn.datasets.load_digits reads: 64 pixels, label
    x = (data[:, :-1] / 16.0).astype(np.float32)
    y = data[:, -1].astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_eval = int(len(x) * EVAL_FRACTION)
    eval_idx, train_idx = order[:n_eval], order[n_eval:]
    return x[train_idx], y[train_idx], x[eval_idx], y[eval_idx]


def _dataset(x: np.ndarray, y: np.ndarray, image: bool) -> TensorDataset:
    features = torch.from_numpy(x)
    if image:
        features = features.reshape(-1, 1, 8, 8)
    return TensorDataset(features, torch.from_numpy(y))


def train_data(image: bool = False) -> TensorDataset:
    """1,438 training examples: 64 floats in [0, 1] (or 1x8x8 images with image=True), label 0..9."""
    x, y, _, _ = _split()
    return _dataset(x, y, image)


def eval_data(image: bool = False) -> TensorDataset:
    """359 held-out examples, never seen in training."""
    _, _, x, y = _split()
    return _dataset(x, y, image)


def mlp(hidden: int = 128, dropout: float = 0.0) -> nn.Module:
    """64 -> hidden -> hidden -> 10 classifier; with `dropout` > 0, a Dropout after each hidden layer (which moves
    the later layers' indices in the state dict: a checkpoint fits the same `dropout` setting)."""
    def hidden_layer(inputs: int) -> list[nn.Module]:
        return [nn.Linear(inputs, hidden), nn.ReLU(), *([nn.Dropout(dropout)] if dropout > 0 else [])]

    return nn.Sequential(*hidden_layer(FEATURES), *hidden_layer(hidden), nn.Linear(hidden, CLASSES))


def cnn(channels: int = 16) -> nn.Module:
    """A small CNN on 1x8x8 images (use with data args image: true)."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * 16, CLASSES),
    )
