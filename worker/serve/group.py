"""The server processes of one pod (an InferencePool's processesPerReplica, `tandem serve --processes N`): each is an
InferenceServer with its own event loop and model replicas, all accepting on the pod's ports (SO_REUSEPORT), and
they talk over Unix sockets in the group's private directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Group:
    """One server process's place in its pod's group: `index` of `size`, sharing `directory` (mode 0700)."""

    directory: Path
    index: int
    size: int

    def socket_path(self, index: int) -> Path:
        """Where process `index` listens for its peers."""
        return self.directory / f"peer-{index}.sock"

    @property
    def leader(self) -> bool:
        """Process 0 follows the training job's checkpoints for the whole group."""
        return self.index == 0
