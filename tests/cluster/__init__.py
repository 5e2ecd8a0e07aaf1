"""A Kubernetes cluster for tests, on this machine: an API emulator (kmock's, fixed), a kubelet that runs pods as
local processes, and `Cluster` to start both from synchronous tests. See harness.py."""

from .emulator import Emulator
from .harness import Cluster
from .kubelet import Kubelet

__all__ = ["Cluster", "Emulator", "Kubelet"]
