"""Data the digits model cannot take, for the fail-fast tests (tests/integration/test_fail_fast.py): 32 features
where `tandem.examples.digits:mlp` expects 64."""

from __future__ import annotations

import os

import torch
from torch.utils.data import TensorDataset


def narrow_data(examples: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(examples, 32, generator=generator),
                         torch.randint(0, 10, (examples,), generator=generator))


def narrow_in_ranks(examples: int = 64) -> TensorDataset:
    """The digits model's 64 features in `tandem run`'s own check, 32 in its ranks (they have a RANK): as data that
    changed between the check and the ranks' start would be."""
    if "RANK" not in os.environ:
        generator = torch.Generator().manual_seed(0)
        return TensorDataset(torch.rand(examples, 64, generator=generator),
                             torch.randint(0, 10, (examples,), generator=generator))
    return narrow_data(examples)
