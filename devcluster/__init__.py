"""A Kubernetes cluster on this machine, for the tests and the operator's benchmark: an API emulator (kmock's,
fixed), a kubelet that runs pods as local processes (with probes and preStop hooks), a minimal Deployment controller,
and `Cluster` to start them from synchronous code, with faults injected per test (faults.py). See harness.py;
`tandem devcluster` runs one with the operator for a person (standalone.py). Not part of the installed package:
tests put the repository root on the path (pyproject's pytest `pythonpath`), benchmarks and `tandem devcluster` do
it themselves."""

from .deployments import DeploymentController
from .emulator import Emulator
from .faults import Faults, Hook, Served
from .harness import Cluster
from .kubelet import Kubelet

__all__ = ["Cluster", "DeploymentController", "Emulator", "Faults", "Hook", "Kubelet", "Served"]
