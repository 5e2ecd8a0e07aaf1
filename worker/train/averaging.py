"""trainingMode averaging: ranks step on their own, then average parameters, buffers (BatchNorm statistics)
and, when asked, optimizer state (torch's model averagers do parameters only)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def replica_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every floating-point tensor that makes up a replica's training state, in a rank-independent order."""
    tensors = [p.data for p in model.parameters()]
    tensors += [b for b in model.buffers() if b.is_floating_point()]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                state = optimizer.state.get(parameter, {})
                tensors += [
                    state[k] for k in sorted(state) if torch.is_tensor(state[k]) and state[k].is_floating_point()
                ]
    return tensors


def average_replicas(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, world_size: int, *,
    wait: Callable[[dist.Work], None] = dist.Work.wait,
) -> int:
    """Replace each replica's state with the mean over ranks; returns the bytes this rank sent. `wait`: how each
    collective is waited for."""
    sent = 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in replica_tensors(model, optimizer):
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for tensors in by_dtype.values():
        flat = _flatten_dense_tensors(tensors)
        wait(dist.all_reduce(flat, async_op=True))
        flat /= world_size
        for tensor, averaged in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
            tensor.copy_(averaged)
        sent += flat.numel() * flat.element_size()
    return sent
