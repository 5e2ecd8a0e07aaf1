"""`tandem operator`: the kopf operator for ParallelTrainingJobs and InferencePools, in every namespace or the
ones named.

It logs in with in-cluster credentials, else KUBECONFIG. Several replicas coordinate through kopf's peering when
the peering resources exist (the Helm chart installs them); a single replica runs without them.
"""

from __future__ import annotations

import argparse
import logging
import os
import random

WORKER_IMAGE_ENV = "TANDEM_WORKER_IMAGE"
DEFAULT_WORKER_IMAGE = "tandem-worker:latest"
LOG_FORMAT = "[%(asctime)s] %(name)s [%(levelname)s] %(message)s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", action="append", default=[], metavar="NS",
                        help="watch this namespace (repeatable; default: all namespaces)")
    parser.add_argument("--worker-image", metavar="IMAGE",
                        default=os.environ.get(WORKER_IMAGE_ENV, DEFAULT_WORKER_IMAGE),
                        help=f"image for jobs that name none in spec.image (default: ${WORKER_IMAGE_ENV}, "
                             f"else {DEFAULT_WORKER_IMAGE})")
    parser.add_argument("--restart-backoff-seconds", type=float, default=10.0, metavar="S",
                        help="base of the exponential backoff between group restarts (default 10)")
    parser.add_argument("--kueue", action="store_true",
                        help="admit jobs labelled kueue.x-k8s.io/queue-name through Kueue: the operator creates, "
                             "watches and updates their Workloads (kueue.x-k8s.io/v1beta2; the chart's "
                             "kueue.enabled grants it that)")
    parser.add_argument("--gang-scheduling", action="store_true",
                        help="create a PodGroup (scheduler-plugins' or Volcano's) for jobs with spec.gang (the "
                             "chart's gangScheduling.enabled grants it that)")
    parser.add_argument("--metrics-port", type=int, metavar="P", help="serve Prometheus metrics on this port")
    parser.add_argument("--health-port", type=int, metavar="P",
                        help="serve kopf's liveness probe on http://0.0.0.0:P/healthz")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--peering", metavar="NAME",
                         help="run as one of several replicas coordinated by kopf's peering object NAME (it must "
                              "exist: a ClusterKopfPeering, or with --namespace a KopfPeering in each namespace): "
                              "the replica of highest --priority works, the others stand by")
    peering.add_argument("--standalone", action="store_true",
                         help="ignore kopf peering objects (one replica): never pause for another kopf operator")
    parser.add_argument("--priority", type=int, metavar="N",
                        help="this replica's peering priority (default with --peering: random, so that replicas never "
                             "tie: kopf pauses every operator of equal priority)")


def run(args: argparse.Namespace) -> int:
    import kopf
    from prometheus_client import start_http_server

    from tandem.operator import handlers, pool_handlers  # noqa: F401 (registers the pools' handlers)
    from tandem.operator.api_policy import KopfRequestFailures
    from tandem.operator.training import Settings

    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    logging.getLogger("tandem.operator").setLevel(logging.INFO)
    for handler in logging.getLogger().handlers:
        handler.addFilter(KopfRequestFailures())

    settings = Settings(worker_image=args.worker_image, restart_backoff_seconds=args.restart_backoff_seconds,
                        kueue=args.kueue, gang_scheduling=args.gang_scheduling)
    if args.kueue:
        handlers.watch_workloads()
    if args.metrics_port is not None:
        start_http_server(args.metrics_port)
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None,
        memo=kopf.Memo(settings=settings),  # every handler's memo is a copy of this one: `memo.settings`
        **peering_options(args),
    )
    return 0


def peering_options(args: argparse.Namespace) -> dict:
    """kopf.run's peering arguments. Without --peering or --standalone, kopf's own default: peering through an
    object named `default` where one exists."""
    if args.standalone:
        return {"standalone": True}
    if args.peering:
        priority = args.priority if args.priority is not None else random.SystemRandom().randrange(1, 2**31)
        return {"peering_name": args.peering, "priority": priority}
    return {} if args.priority is None else {"priority": args.priority}
