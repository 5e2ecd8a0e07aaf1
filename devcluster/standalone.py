"""`tandem devcluster`: the emulated cluster (harness.py's `Cluster`) with the operator, for a person at a terminal.

It starts the API server, its kubelet and the Deployment controller, applies the CRDs, starts `tandem operator`
against them, prints the `export KUBECONFIG=...` line and what to try, and runs until SIGINT or SIGTERM (or the
operator's end), then stops the operator, every pod's process and the API server (`Cluster.shutdown`).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from .harness import REPO, Cluster

NAMESPACE = "default"
POOL_ADDRESS = ("curl $(kubectl get pods -l tandem.dev/pool=digits -o jsonpath='{.items[0].status.podIP}')"
                ":8000/v2/health/ready")
"""What stands in for `kubectl port-forward svc/digits 8000:8000` here (the README's quick start says the same): each
server listens on its pod's own loopback address (network.py)."""


def run(directory: Path | None) -> int:
    if directory is not None and directory.is_dir() and any(directory.iterdir()):
        # Its claims would outlive the objects of the API server they belonged to: a job of the same name would meet
        # another run's checkpoints.
        print(f"tandem devcluster: {directory} is not empty (an earlier cluster's files?): give a new or empty "
              "directory, or delete it", file=sys.stderr)
        return 2
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    with Cluster(directory, namespaces=[NAMESPACE]) as cluster:
        operator = cluster.spawn([sys.executable, "-m", "tandem.cli", "operator", "--namespace", NAMESPACE],
                                 name="operator", cwd=REPO)
        print(banner(cluster, kept=directory is not None), flush=True)
        while not stopping.wait(1):
            if operator.poll() is not None:
                print(f"tandem devcluster: the operator exited ({operator.returncode}); its log:\n"
                      f"{cluster.process_log('operator')[-4000:]}", file=sys.stderr, flush=True)
                return 1
        print("tandem devcluster: stopping the operator, the pods and the API server", flush=True)
    print("tandem devcluster: stopped", flush=True)
    return 0


def banner(cluster: Cluster, kept: bool) -> str:
    files = "kept" if kept else "removed on exit; --dir DIR keeps them"
    return f"""\
tandem devcluster: an emulated Kubernetes API server at {cluster.url}, a kubelet that runs pods as local
processes, and `tandem operator` (namespace {NAMESPACE}); the CRDs are applied.
  files:        {cluster.root} (claims, pods' logs; {files})
  operator log: {cluster.root / "processes" / "operator.log"}

In another shell, at the repository's root:

export KUBECONFIG={cluster.kubeconfig}

then follow the README's "Quick start on a cluster" from "Train the digits example" on (no images, no helm): the
claim, the job, `kubectl get trainingjobs`, the pool, `kubectl get tip`. Instead of `kubectl port-forward`, which
this API server does not serve, ask a server at its pod IP:
  {POOL_ADDRESS}

Ctrl-C stops the operator, every pod and the API server."""
