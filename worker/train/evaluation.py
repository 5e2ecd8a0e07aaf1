"""Evaluation at the end of training: the eval set sharded over the ranks, totals summed across them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from tandem.worker.train.data import evaluation_shard
from tandem.worker.train.step import loss_for


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Dataset, *, rank: int, world_size: int, device: torch.device,
             batch_size: int, wait: Callable[[dist.Work], None] = dist.Work.wait) -> dict[str, float]:
    """Eval loss and, for integer labels, accuracy (0..1) over the whole eval set, sharded across ranks (their
    totals summed in a collective waited for with `wait`)."""
    was_training = model.training
    model.eval()
    try:  # abandoned (an elastic job's peer lost), training goes on in training mode all the same
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
        shard = evaluation_shard(dataset, rank=rank, world_size=world_size)
        for inputs, targets in DataLoader(shard, batch_size=max(batch_size, 256)):
            inputs, targets = inputs.to(device), targets.to(device)
            outputs = model(inputs)
            totals[0] += float(loss_for(outputs, targets)) * len(targets)
            if not targets.is_floating_point():
                totals[1] += float((outputs.argmax(dim=1) == targets).sum())
            totals[2] += len(targets)
        wait(dist.all_reduce(totals, async_op=True))
    finally:
        model.train(was_training)
    count = max(totals[2].item(), 1.0)
    metrics = {"evalLoss": totals[0].item() / count}
    if not dataset[0][1].is_floating_point():
        metrics["accuracy"] = totals[1].item() / count
    return metrics
