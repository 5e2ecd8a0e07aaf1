"""The `tandem` command."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from tandem import __version__, contract
from tandem.manifest import ManifestError, load_file


def _crds(args: argparse.Namespace) -> int:
    from tandem.crd import crd_files, write_crds

    if args.out is None:
        sys.stdout.write("---\n".join(crd_files().values()))
        return 0
    for path in write_crds(Path(args.out)):
        print(f"wrote {path}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    failed = 0
    for file in args.files:
        try:
            resources = load_file(file)
        except ManifestError as error:
            print(error, file=sys.stderr)
            failed += 1
            continue
        for resource in resources:
            problem, checked = _inputs_checked(resource, deep=args.deep)
            if problem is not None:
                print(f"{file}: {resource.kind}/{resource.metadata.name}: {problem}", file=sys.stderr)
                failed += 1
            else:
                print(f"{file}: {resource.kind}/{resource.metadata.name} is valid{checked}")
    return 1 if failed else 0


def _inputs_checked(resource, *, deep: bool) -> tuple[str | None, str]:
    """A ParallelTrainingJob's model, data or custom command checked as `tandem run` checks them before starting:
    with `deep`, or by default where its data is on this machine. (the problem or None, what was checked)."""
    if resource.kind != "ParallelTrainingJob":
        return None, ""
    from tandem.worker.train.invalid import InvalidModelOrData
    from tandem.worker.train.preflight import check_job, data_elsewhere

    spec = resource.spec
    if not deep and spec.training_mode == "custom":  # its command is the image's
        return None, ""
    if not deep and (elsewhere := data_elsewhere(spec.trainer)) is not None:
        return None, f" (its model and data are not checked: {elsewhere!r} is not on this machine; --deep checks them)"
    try:
        check_job(spec)
    except InvalidModelOrData as error:
        return f"InvalidModelOrData: {error}", ""
    if spec.training_mode == "custom":
        return None, "; its command can start"
    return None, "; one batch of its data went through its model"


def _run(args: argparse.Namespace) -> int:
    from tandem.backends.local import run

    return run(args.file, workers=args.workers, status_out=args.status_out, output=args.output,
               restart_backoff_seconds=args.restart_backoff_seconds)


def _plot(args: argparse.Namespace) -> int:
    from tandem.curves import NoCurves, plot

    try:
        drawn = plot(Path(args.run_dir), Path(args.out))
    except NoCurves as error:
        print(f"tandem plot: {error}", file=sys.stderr)
        return 1
    for run, series in drawn.items():
        counts = ", ".join(f"{tag} {len(points)} points" for tag, points in series.items())
        print(f"{run}: {counts}")
    print(f"wrote {args.out}")
    return 0


def _worker(args: argparse.Namespace) -> int:
    if args.role == "launch":
        from tandem.worker.train.launch import launch

        return launch(Path(args.termination_log))
    if args.role == "coordinator":
        from tandem.worker.train.coordinator import cli as coordinator

        return coordinator()
    from tandem.worker.train.signals import block_stop_signals

    block_stop_signals()  # before torch starts any thread
    from tandem.worker.train.entrypoint import cli

    return cli()


def _serve(args: argparse.Namespace) -> int:
    """`tandem serve [FILE] [--port P] [--grpc-port P | --no-grpc] [--host H] [--checkpoint PATH] [--grace-period S]
    [--auth-token-file PATH] [--watch-pool] [--processes N] [--http-front F]
    [--idle-timeout SECONDS]`: FILE, or else the
    InferencePool at $TANDEM_SPEC (the worker contract: what an InferencePool's pods run)."""
    import asyncio
    import logging

    from tandem.api.inference import InferencePool
    from tandem.manifest import load_one
    from tandem.worker.serve.processes import front_carries_grpc, member_from_environment, supervise

    path = args.file or os.environ.get(contract.SPEC)
    if not path:
        print(f"tandem serve: no InferencePool to serve: give its manifest FILE, or set {contract.SPEC} to its path "
              "(the worker contract, tandem/contract.py)", file=sys.stderr)
        return 2
    member = member_from_environment()
    prefix = "tandem serve" if member is None else f"tandem serve [{member.group.index + 1}/{member.group.size}]"
    logging.basicConfig(level=logging.INFO, format=f"{prefix}: %(message)s", stream=sys.stderr)
    try:
        pool = load_one(path, InferencePool)
    except ManifestError as error:
        print(error, file=sys.stderr)
        return 1
    if args.http_front is not None:
        pool.spec.http_front = args.http_front
    if args.idle_timeout is not None:
        pool.spec.idle_timeout_seconds = args.idle_timeout
    port = pool.spec.port if args.port is None else args.port
    grpc_port = None if args.no_grpc else pool.spec.grpc_port if args.grpc_port is None else args.grpc_port
    processes = pool.spec.processes_per_replica if args.processes is None else args.processes
    if member is None and processes > 1:
        return supervise(args.command_line, args.host, port, grpc_port, processes,  # imports no torch
                         front_carries_grpc(pool.spec.http_front, pool.spec.inference_mode))
    from tandem.worker.process_exit import exit_without_teardown
    from tandem.worker.serve.app import InferenceServer  # imports torch
    from tandem.worker.serve.auth import AuthTokenError
    from tandem.worker.serve.background import new_event_loop
    from tandem.worker.serve.model_loading import ModelLoadError
    from tandem.worker.serve.processes import HandedOver

    try:
        server = InferenceServer(pool, args.checkpoint, grace_seconds=args.grace_period,
                                 auth_token_file=args.auth_token_file,
                                 watch_pool=args.watch_pool,
                                 group=None if member is None else member.group)
    except (ModelLoadError, AuthTokenError) as error:
        print(error, file=sys.stderr)
        return 1
    if member is None:
        listen = (port, grpc_port, None)
    else:  # the supervisor accepts, and hands the connections over
        grpc_listen = member.grpc_port if member.grpc_port is None or not member.grpc_handed_over \
            else HandedOver(member.grpc_port)  # else each process's grpc.aio binds the port (SO_REUSEPORT)
        listen = (HandedOver(member.http_port), grpc_listen, member.channel)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        code = runner.run(server.run(args.host, *listen))
    exit_without_teardown(code)  # a forward still running past the grace period would abort the teardown


def _devcluster(args: argparse.Namespace) -> int:
    checkout = Path(__file__).resolve().parents[1]
    if not (checkout / "devcluster").is_dir():
        print("tandem devcluster: runs from a checkout of the repository (devcluster/ is not part of the installed "
              "package): `make devcluster` there", file=sys.stderr)
        return 2
    sys.path.insert(0, str(checkout))  # the checkout's devcluster/, as the tests and benchmarks import it
    try:
        from devcluster.standalone import run
    except ModuleNotFoundError as error:
        print(f"tandem devcluster: needs the test extra ({error}): `make setup`, or pip install -e '.[test]'",
              file=sys.stderr)
        return 2
    return run(None if args.dir is None else Path(args.dir))


def _process_count(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of processes: give a whole number, 1 or more")
    return int(value)


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not seconds > 0 or math.isinf(seconds):
        raise argparse.ArgumentTypeError(f"{value!r} is not a time in seconds: give a number above 0, as in 60 or 0.5")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Data-parallel PyTorch training and batched inference, on one machine or on Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    crds = commands.add_parser("crds", help="print the CustomResourceDefinitions, or write them to a directory")
    crds.add_argument("--out", metavar="DIR", help="write one YAML file per CRD into DIR (e.g. crds/)")
    crds.set_defaults(handler=_crds)

    validate = commands.add_parser("validate", help="check manifests against the CRD schema and the API model, and "
                                                    "a job's model against its data")
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.add_argument("--deep", action="store_true",
                          help="check each ParallelTrainingJob as `tandem run` does before starting: resolve its model "
                               "and data and push one batch of the data through the model (a custom job: its command "
                               "can start). By default only where its data is on this machine")
    validate.set_defaults(handler=_validate)

    run = commands.add_parser("run", help="run a ParallelTrainingJob on this machine, one process per rank")
    run.add_argument("file", metavar="FILE")
    run.add_argument("--workers", type=int, metavar="N", help="ranks to start (overrides spec.workers)")
    run.add_argument("--status-out", metavar="PATH", help="also write the final status as JSON to PATH")
    run.add_argument("-o", "--output", choices=("summary", "json"), default="summary",
                     help="what stdout shows at the end: a short summary (default), or the final status as JSON (the "
                          "object a cluster keeps in the job's .status)")
    run.add_argument("--restart-backoff-seconds", type=float, default=10.0, metavar="S",
                     help="base of the backoff before a failed group restarts, doubling per restart (default 10)")
    run.set_defaults(handler=_run)

    plot = commands.add_parser("plot", help="draw a training run's loss and eval accuracy against the step, from "
                                            "the TensorBoard event files rank 0 writes, as a PNG")
    plot.add_argument("run_dir", metavar="RUN_DIR",
                      help="the job's checkpoint directory (spec.checkpoint.directory), its tensorboard/ folder, or "
                           "one run's folder in it")
    plot.add_argument("-o", "--out", default="curves.png", metavar="PNG", help="where to write it (default curves.png)")
    plot.set_defaults(handler=_plot)

    worker = commands.add_parser("worker", help="run one rank (train), a pod's ranks (launch), or an elastic job's "
                                                "coordinator (its store and planner), from the worker contract env "
                                                "(what pods run)")
    worker.add_argument("role", choices=["train", "launch", "coordinator"])
    worker.add_argument("--termination-log", default="/dev/termination-log", metavar="PATH",
                        help="launch: where a failed rank's cause is written for the pod's status "
                             "(the container's terminationMessagePath)")
    worker.set_defaults(handler=_worker)

    serve = commands.add_parser("serve", help="serve an InferencePool's model on this machine")
    serve.add_argument("file", metavar="FILE", nargs="?",
                       help=f"the InferencePool's manifest (default: the file at ${contract.SPEC})")
    serve.add_argument("--port", type=int, help="HTTP port (default: the manifest's spec.port)")
    grpc = serve.add_mutually_exclusive_group()
    grpc.add_argument("--grpc-port", type=int, metavar="PORT",
                      help="gRPC port of the inference protocol (default: the manifest's spec.grpcPort, 8001)")
    grpc.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--checkpoint", metavar="PATH", help="serve this trainer checkpoint instead of spec.model")
    serve.add_argument("--grace-period", type=float, default=25.0, metavar="SECONDS",
                       help="on SIGTERM: how long queued and running requests may take to finish (default 25)")
    serve.add_argument("--auth-token-file", metavar="PATH",
                       help="clients must send this file's token (Authorization: Bearer <token>); read again when "
                            "it changes. Required when the pool has spec.auth")
    serve.add_argument("--watch-pool", action="store_true",
                       help="follow the InferencePool's batchLimit, queueLimit, maxQueueDelayMicroseconds and "
                            "requestTimeoutMs in the Kubernetes API (the manifest's name and namespace; in-cluster "
                            "credentials, else KUBECONFIG) while serving: the operator starts its servers so, with a "
                            "ServiceAccount that may get and watch that one pool (off by default: the manifest's)")
    serve.add_argument("--idle-timeout", type=_seconds, metavar="SECONDS",
                       help="close a connection to either port with no request in flight after this long (default: "
                            "the manifest's spec.idleTimeoutSeconds, 60)")
    serve.add_argument("--processes", type=_process_count, metavar="N",
                       help="server processes sharing the ports, each with its own event loop and the pool's "
                            "workersPerReplica model replicas, under a supervisor (default: the manifest's "
                            "spec.processesPerReplica, 1)")
    serve.add_argument("--http-front", choices=("python", "native"),
                       help="who reads the HTTP and gRPC ports: native (a C front serving the common inference "
                            "request, JSON or gRPC's ModelInfer with raw contents, with no Python per request, the "
                            "rest handed to the Python server) or python (default: the manifest's spec.httpFront, "
                            "native)")
    serve.set_defaults(handler=_serve)

    from tandem.operator import main as operator_main  # its options only: kopf is imported when it runs

    operator = commands.add_parser("operator", help="run the Kubernetes operator (ParallelTrainingJobs)")
    operator_main.add_arguments(operator)
    operator.set_defaults(handler=operator_main.run)

    devcluster = commands.add_parser(
        "devcluster", help="try the operator without a cluster: an emulated API server, a kubelet running pods as "
                           "local processes, and the operator, until Ctrl-C (from a checkout: devcluster/)",
        description="Run an emulated Kubernetes API server (devcluster/), a kubelet that runs pods' commands as local "
                    "processes, and `tandem operator`, with the CRDs applied, until Ctrl-C (or SIGTERM) stops them "
                    "all. Prints the `export KUBECONFIG=...` line for kubectl. From a checkout of the repository "
                    "after `make setup`.")
    devcluster.add_argument("--dir", metavar="DIR",
                            help="keep the cluster's files here: kubeconfig, claims, pods' and the operator's logs "
                                 "(default: a temporary directory, removed on exit)")
    devcluster.set_defaults(handler=_devcluster)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = sys.argv[1:] if argv is None else argv  # what `tandem serve --processes N` starts N of
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
