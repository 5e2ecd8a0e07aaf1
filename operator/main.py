"""`tandem operator`: the kopf operator for ParallelTrainingJobs, in every namespace or the ones named.

It logs in with in-cluster credentials, else KUBECONFIG. Several replicas coordinate through kopf's peering when
the peering resources exist (the Helm chart installs them); a single replica runs without them.
"""

from __future__ import annotations

import argparse
import os

WORKER_IMAGE_ENV = "TANDEM_WORKER_IMAGE"
DEFAULT_WORKER_IMAGE = "tandem-worker:latest"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", action="append", default=[], metavar="NS",
                        help="watch this namespace (repeatable; default: all namespaces)")
    parser.add_argument("--worker-image", metavar="IMAGE",
                        default=os.environ.get(WORKER_IMAGE_ENV, DEFAULT_WORKER_IMAGE),
                        help=f"image for jobs that name none in spec.image (default: ${WORKER_IMAGE_ENV}, "
                             f"else {DEFAULT_WORKER_IMAGE})")
    parser.add_argument("--restart-backoff-seconds", type=float, default=10.0, metavar="S",
                        help="base of the exponential backoff between group restarts (default 10)")
    parser.add_argument("--metrics-port", type=int, metavar="P", help="serve Prometheus metrics on this port")
    parser.add_argument("--health-port", type=int, metavar="P",
                        help="serve kopf's liveness probe on http://0.0.0.0:P/healthz")


def run(args: argparse.Namespace) -> int:
    import kopf
    from prometheus_client import start_http_server

    from tandem.operator import handlers
    from tandem.operator.training import Settings

    handlers.SETTINGS = Settings(worker_image=args.worker_image, restart_backoff_seconds=args.restart_backoff_seconds)
    if args.metrics_port is not None:
        start_http_server(args.metrics_port)
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None,
    )
    return 0
