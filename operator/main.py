"""`tandem operator`: the kopf operator for ParallelTrainingJobs and InferencePools, in every namespace or the
ones named.

It logs in with in-cluster credentials, else KUBECONFIG. With --leader-elect (the chart's default), several
replicas elect one leader through a Lease (election.py): the others stand by, warm, and take over within a lease
duration of a crash, or a retry period of a clean stop. Without it, kopf's peering is available as before.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
    election = parser.add_argument_group("leader election (a coordination.k8s.io/v1 Lease)")
    election.add_argument("--leader-elect", action="store_true",
                          help="run as one of several replicas: the one holding the Lease reconciles, the others "
                               "stand by and take over when it stops renewing it")
    election.add_argument("--leader-election-id", default="tandem-operator", metavar="NAME",
                          help="the Lease's name (default tandem-operator)")
    election.add_argument("--leader-election-namespace", metavar="NS",
                          help="the Lease's namespace (default: the operator's own in a cluster, else the first "
                               "--namespace, else default)")
    election.add_argument("--leader-elect-lease-duration", type=float, default=15.0, metavar="S",
                          help="how long a standby waits, after it saw the leader's last renewal, before it takes "
                               "over (default 15)")
    election.add_argument("--leader-elect-renew-deadline", type=float, default=10.0, metavar="S",
                          help="how long the leader keeps trying to renew before it stops writing and exits "
                               "(default 10; shorter than the lease duration)")
    election.add_argument("--leader-elect-retry-period", type=float, default=2.0, metavar="S",
                          help="how often the leader renews and a standby looks at the Lease (default 2)")
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
    problem = election_problem(args)
    if problem is not None:
        print(f"tandem operator: {problem}", file=sys.stderr)
        return 2
    import kopf
    from prometheus_client import start_http_server

    from tandem.operator import handlers, metrics, pool_handlers  # noqa: F401 (registers the pools' handlers)
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
    elector = None
    if args.leader_elect:
        elector = stand_by(args)
        if elector is None:
            return 0  # stopped while standing by
    else:
        metrics.LEADER.set(1)
    try:
        kopf.run(
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None,
            memo=kopf.Memo(settings=settings),  # every handler's memo is a copy of this one: `memo.settings`
            **peering_options(args),
        )
    finally:
        if elector is not None:
            elector.stop()  # after kopf's last write: a standby takes over within a retry period
    return 0


def election_timing(args: argparse.Namespace):
    from tandem.operator.election import Timing

    return Timing(args.leader_elect_lease_duration, args.leader_elect_renew_deadline, args.leader_elect_retry_period)


def election_problem(args: argparse.Namespace) -> str | None:
    """Why the election flags cannot work together (None: they can)."""
    if not args.leader_elect:
        return None
    if args.peering:
        return "--leader-elect and --peering are two ways to coordinate replicas: give one"
    return election_timing(args).problem()


def stand_by(args: argparse.Namespace):
    """Stand by (warm: handlers imported, metrics served, /healthz answered) until this replica leads: its Elector,
    renewing the Lease from then on; None if SIGTERM or SIGINT came first. Every write of the operator's and kopf's
    passes the leadership's check from now on (leadership.py)."""
    import kopf

    from tandem.operator import election, leadership
    from tandem.operator.cluster import login

    held = leadership.Leadership()
    leadership.install(held)
    kopf.on.login()(election.guarded_login)
    namespace = args.leader_election_namespace or election.default_namespace(args.namespace)
    elector = election.Elector(login(guarded=False), args.leader_election_id, namespace, election.identity(),
                               election_timing(args), held)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    elector.start()
    try:
        with standby_health(args.health_port):
            while not elector.elected.wait(0.1):
                if stop.is_set():
                    elector.stop()
                    return None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return elector


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/healthz" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@contextmanager
def standby_health(port: int | None) -> Iterator[None]:
    """A standby's /healthz on `port` (kopf's liveness endpoint answers there once it leads): alive while it stands
    by, so that its Deployment does not restart it for waiting."""
    if port is None:
        yield
        return
    server = ThreadingHTTPServer(("0.0.0.0", port), _Healthy)
    threading.Thread(target=server.serve_forever, name="tandem-standby-health", daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def peering_options(args: argparse.Namespace) -> dict:
    """kopf.run's peering arguments. Without --peering or --standalone, kopf's own default: peering through an
    object named `default` where one exists."""
    if args.standalone or args.leader_elect:  # elected: the leader runs alone
        return {"standalone": True}
    if args.peering:
        priority = args.priority if args.priority is not None else random.SystemRandom().randrange(1, 2**31)
        return {"peering_name": args.peering, "priority": priority}
    return {} if args.priority is None else {"priority": args.priority}
