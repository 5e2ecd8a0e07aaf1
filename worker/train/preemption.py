"""What a preemption would cost now: `status.preemptionCost`, which rank 0 reports with its progress.

Stopped with a grace period, the ranks checkpoint at an agreed step and lose only the time that save takes
(`checkpointSeconds`, measured by `Checkpointer.save` on rank 0); killed outright, they lose the steps done since
the last complete checkpoint (`stepsSinceCheckpoint`). Both sinks carry it: the status file `tandem run` reads and
the job's status subresource (status_sink.py).
"""

from __future__ import annotations

from tandem.api import ParallelTrainingJobStatus
from tandem.api.training import PreemptionCost


def preemption_cost(status: ParallelTrainingJobStatus, checkpoint_seconds: float | None) -> PreemptionCost:
    """The cost at `status.progress.step`: the steps since `status.checkpoint` (every step done so far before any
    checkpoint), and the seconds the latest checkpoint took to write (None before this process wrote one)."""
    checkpoint = status.checkpoint
    checkpointed = (checkpoint.step or 0) if checkpoint.latest is not None else 0
    return PreemptionCost(steps_since_checkpoint=max(0, status.progress.step - checkpointed),
                          checkpoint_seconds=checkpoint_seconds)
