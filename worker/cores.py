"""How many CPU cores this process may use, and splitting them between the processes or replicas that share
them (ranks on one machine, model replicas in one server), so that they do not oversubscribe the cores."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_V2_LIMIT = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask), capped by its container's CPU limit: a pod limited
    to 2 CPUs on a 64-core node sees 64 in the mask, and 64 threads there would mostly wait for their quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = _cgroup_cpu_limit()
    return max(1, min(cores, math.ceil(limit))) if limit is not None else cores


def _cgroup_cpu_limit() -> float | None:
    try:
        if CGROUP_V2_LIMIT.is_file():
            quota, period = CGROUP_V2_LIMIT.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if CGROUP_V1_QUOTA.is_file():
            quota = int(CGROUP_V1_QUOTA.read_text())
            return None if quota <= 0 else quota / int(CGROUP_V1_PERIOD.read_text())
    except (OSError, ValueError):
        return None
    return None


def share_cores(parts: int) -> None:
    """Give torch this process's share of the cores when `parts` processes or replicas run on them at once;
    OMP_NUM_THREADS, when set, decides instead."""
    import torch

    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, available_cores() // parts))
