"""Inference server benchmarks (issue #4), on a model large enough that compute matters on CPU: the digits MLP
with 3072 hidden units (64 -> 3072 -> 3072 -> 10, 9.7 M parameters; --hidden to change), one example per
request, JSON bodies. Every server runs in its own process; one load generator (bench/loadgen.py, closed
loop, keep-alive connections) drives them all from this process, on the same cores.

1. batched vs sequential: `tandem serve` in each mode at concurrency 1, 8 and 64: requests/s, p50, p99.
   Ratio printed: batched / sequential throughput at each concurrency (target >= 3x at 64).
2. ceiling: the same model's raw batched forward in process (batch = batchLimit, the same threads), in
   examples/s. Ratios printed: the batched server's throughput at concurrency 64, and at 256 (where it stops
   growing: its capacity), over the ceiling (target >= 0.6).
   step: the raw forward of replicas sharing one model in step and out of step (each pausing a random time up to
   its last forward's after each, as replicas fed by separate queues run), beside a copy each, alternating over
   rounds. Ratio printed: CPU per example out of step / in step (what reading the weights together saves).
3. LitServe serving the same model with its batching on (max_batch_size = 32), at concurrency 64 (and 8),
   best of its configurations tried. Ratio printed: tandem / LitServe throughput, and both p99s (target >= 1.5x
   at equal or lower p99).
4. wrk: the batched server driven by a load generator that is not Python (wrk, C, one thread, keep-alive, the
   request from bench/wrk_infer.lua) at 8, 64 and 256 connections, beside bench/loadgen.py at the same points,
   and the raw forward's ceiling measured after each round (the best of the rounds, as for the served figures).
   Ratio printed: wrk's req/s / the ceiling (issue 20's
   targets: >= 0.7 at 64, >= 0.8 at 256), with p99, and where each request's time goes (bench/serve_costs.py: CPU
   per request of the event loop, the workers and the load generator, batch sizes, queue wait). wrk comes from the
   Debian archive (`apt-get install wrk`); the part is skipped, saying so, where it is missing. With --against REF
   the server as it is at git REF runs too, alternating with this tree's, and this tree's figures over REF's are
   printed. With --client-cpus LIST the load generators run on those CPUs and the servers and the ceiling on the
   others, which takes the client's CPU out of the comparison. Below each table, the bound: the share of the ceiling
   the cores could reach at the loop's and the client's measured CPU per request if the workers cost no more than
   the raw forward (`bound`), so that a run says whether a target is out of reach of anything the workers do.
5. grpc: the same over gRPC, driven by h2load (C; Debian's nghttp2-client) posting a pre-serialised
   ModelInferRequest at 8, 64 and 256 concurrent calls; skipped, saying so, where h2load is missing. --against,
   --rounds and the bound as for wrk.
6. native: `tandem serve` with httpFront python and native (the C front: no Python per common request, HTTP or
   gRPC), both as one process per worker, under wrk (HTTP) and h2load (gRPC) at each point, alternating over
   --rounds, the ceiling after each round. Printed: each one's share of the ceiling and its bound, CPU per request
   (request path, workers, load generator), and native / python.

    .venv/bin/python bench/bench_inference.py                 # parts 1-3, about 2 minutes on 2 cores
    .venv/bin/python bench/bench_inference.py --only modes --seconds 5
    .venv/bin/python bench/bench_inference.py --only step --seconds 1.5 --rounds 6   # in step against out of step
    .venv/bin/python bench/bench_inference.py --only wrk        # wrk and loadgen side by side, and the ceiling
    .venv/bin/python bench/bench_inference.py --only wrk --rounds 3 --against main   # A/B against main
    .venv/bin/python bench/bench_inference.py --only wrk --client-cpus 1   # wrk on CPU 1, the server on the others
    .venv/bin/python bench/bench_inference.py --only grpc       # h2load over gRPC
    .venv/bin/python bench/bench_inference.py --only native --connections 64,256 --rounds 3   # the two fronts
    .venv/bin/python bench/bench_inference.py --only grpc --rounds 2 --against main   # A/B against main
    .venv/bin/python bench/bench_inference.py --only grpc --connections 64,256 --rounds 6 --against main
                                                              # fewer points, more rounds: a change of ~5% resolved

Needs the `bench` extra for part 3 (pip install -e '.[bench]').
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import LoadResult, build_request, load, wait_for_port  # noqa: E402
from serve_costs import (  # noqa: E402
    COSTS_HEADER,
    Costs,
    ServeCosts,
    children_cpu,
    server_processes,
    split_threads,
    thread_times,
)

ROOT = Path(__file__).resolve().parent.parent
HIDDEN = 3072
BATCH_LIMIT = 32
SATURATED = 256  # concurrency at which the batched server's throughput stops growing: its capacity
HOST = "127.0.0.1"
DEVICE = "cpu"
EXAMPLE = np.random.default_rng(0).random(64, dtype=np.float32)
CLIENT_CPUS: set[int] | None = None  # --client-cpus: where the load generators run (the servers and ceiling elsewhere)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Server:
    """A server process in a process group of its own; stopping it stops the group (LitServe's workers are
    child processes that outlive their parent otherwise)."""

    def __init__(self, command: list[str], port: int, ready_path: str, source: Path | None = None,
                 variables: dict[str, str] | None = None, grpc_port: int | None = None):
        self.port = port
        self.grpc_port = grpc_port
        environment = {**os.environ, **(variables or {}), **({} if source is None else {"PYTHONPATH": str(source)})}
        # Its log in a file, not a pipe nobody reads while it runs: a server kept up for a whole benchmark would
        # block on a full pipe.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in __exit__, or at once if it never starts)
        self.process = subprocess.Popen(command, cwd=source or ROOT, env=environment, stdout=subprocess.DEVNULL,
                                        stderr=self.log, text=True, start_new_session=True)
        try:
            asyncio.run(wait_for_port(HOST, port, ready_path, timeout=120))
        except BaseException:
            self.stop()
            self.log.seek(0)
            print(self.log.read()[-3000:], file=sys.stderr)
            self.log.close()
            raise

    def stop(self) -> None:
        group = self.process.pid  # start_new_session: the group id is the server's pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        time.sleep(0.5)  # let the group's other processes act on SIGTERM
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        self.log.close()


def tandem_server(mode: str, workers: int, directory: Path, source: Path | None = None,
                  grpc_port: int | None = None, variables: dict[str, str] | None = None, processes: int = 1,
                  http_front: str | None = None) -> Server:
    """`tandem serve` with the pool below; from the code in `source` (a `checkout`) instead of this tree's when
    given; with gRPC on `grpc_port` when given; with the environment `variables` added; as `processes` server
    processes of workers / processes workers each (processesPerReplica); with the HTTP front `http_front` (None: the
    pool's default)."""
    manifest = directory / f"pool-{mode}-{processes}-{http_front}.yaml"
    spec = {"model": {"callable": "tandem.examples.digits:mlp", "args": {"hidden": HIDDEN}, "inputShape": [64]},
            "inferenceMode": mode, "workersPerReplica": max(1, workers // processes), "batchLimit": BATCH_LIMIT,
            "queueLimit": 256, "gpusPerReplica": 1 if DEVICE == "cuda" else 0}
    if processes > 1:  # only then: the code at a git ref older than processesPerReplica still reads the manifest
        spec["processesPerReplica"] = processes
    if http_front is not None:  # likewise
        spec["httpFront"] = http_front
    manifest.write_text(json.dumps({"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool",
                                    "metadata": {"name": "mlp"}, "spec": spec}))
    port = free_port()
    grpc = ["--no-grpc"] if grpc_port is None else ["--grpc-port", str(grpc_port)]
    return Server([sys.executable, "-m", "tandem.cli", "serve", str(manifest), "--port", str(port), *grpc], port,
                  "/v2/health/ready", source, variables, grpc_port)


def checkout(ref: str, directory: Path) -> Path:
    """The tandem package as it is at git `ref`, laid out to import ahead of this tree's editable install (from the
    working directory and PYTHONPATH: tandem/worker and tandem/operator mapped as pyproject's package-dir maps
    them, with its C front built where it has one), for A/B runs."""
    source = directory / "source"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    if (source / "setup.py").exists():  # the C front of that ref, built beside its sources
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=source, check=True,
                       capture_output=True)
    package = directory / "importable"
    shutil.copytree(source / "tandem", package / "tandem")
    for name in ("worker", "operator"):
        (package / "tandem" / name).symlink_to(source / name, target_is_directory=True)
    return package


def tandem_request(port: int) -> bytes:
    body = orjson.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                                     "data": EXAMPLE.tolist()}]})
    return build_request(HOST, port, "/v2/models/mlp/infer", body)


def check_tandem(body: bytes) -> None:
    if len(orjson.loads(body)["outputs"][0]["data"]) != 10:
        raise AssertionError(body[:200])


def drive(port: int, request: bytes, concurrency: int, seconds: float, check=None) -> LoadResult:
    with _on_client_cpus():
        return load(HOST, port, request, concurrency=concurrency, seconds=seconds, warmup=0.5, check=check)


@contextlib.contextmanager
def _on_client_cpus():
    """This thread (bench/loadgen.py's event loop) on the client's CPUs meanwhile, where --client-cpus gave them."""
    if CLIENT_CPUS is None:
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, CLIENT_CPUS)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def run_client(command: list[str], **options) -> subprocess.CompletedProcess:
    """A load generator's command (wrk, h2load), on the client's CPUs where --client-cpus gave them."""
    pin = None if CLIENT_CPUS is None else lambda: os.sched_setaffinity(0, CLIENT_CPUS)
    return subprocess.run(command, check=True, capture_output=True, preexec_fn=pin, **options)


def bench_modes(seconds: float, workers: int, directory: Path) -> dict[tuple[str, int], LoadResult]:
    results = {}
    for mode in ("batched", "sequential"):
        with tandem_server(mode, workers, directory) as server:
            request = tandem_request(server.port)
            drive(server.port, request, 8, 1.0, check_tandem)  # one more warm-up, with answers checked
            for concurrency in (1, 8, 64) if mode == "sequential" else (1, 8, 64, SATURATED):
                result = results[mode, concurrency] = drive(server.port, request, concurrency, seconds)
                print(f"tandem {mode:10s} c={concurrency:<3d} {result.line()}", flush=True)
    for concurrency in (1, 8, 64):
        ratio = results["batched", concurrency].rps / results["sequential", concurrency].rps
        print(f"batched / sequential throughput at c={concurrency}: {ratio:.2f}x")
    return results


def bench_ceiling(seconds: float, workers: int) -> float:
    """Examples/s of model(x) on batches of BATCH_LIMIT in this process, nothing else running: `workers` threads
    (cores // workers torch threads each, as `tandem serve` sets them) sharing one copy of the model as the server's
    workers do, the same threads with a copy each (as the server ran before), and one replica using every core. The
    best of the three is the ceiling."""
    threads = max(1, cores() // workers)
    results = [_forward_rate(seconds, workers, threads, shared=True)]
    if workers != 1:
        results.append(_forward_rate(seconds, workers, threads))
        results.append(_forward_rate(seconds, 1, cores()))
    return max(forward.rate for forward in results)


def bench_step(seconds: float, workers: int, rounds: int) -> None:
    """The raw forward of `workers` replicas sharing one model, in step (each starts its next forward at once, so
    they read the weights together) and out of step (each pauses a random time up to its last forward's after each,
    as replicas fed by separate queues do), beside a copy each; the three alternate for `rounds` rounds of `seconds`.
    Printed: the medians of CPU per example, and out of step / in step."""
    threads = max(1, cores() // workers)
    kinds = {"in step, sharing one model": {"shared": True}, "out of step, sharing one model": {"shared": True,
             "out_of_step": True}, "in step, a copy each": {}}
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(rounds):
        for kind, options in kinds.items():
            cpu[kind].append(_forward_rate(seconds, workers, threads, **options).cpu_us)
    medians = {kind: statistics.median(found) for kind, found in cpu.items()}
    for kind, median in medians.items():
        print(f"step: {kind}: median {median:.0f} us of CPU per example over {rounds} rounds "
              f"({', '.join(f'{found:.0f}' for found in cpu[kind])})")
    in_step = medians["in step, sharing one model"]
    print(f"step: out of step / in step, sharing one model: {medians['out of step, sharing one model'] / in_step:.2f}x "
          f"the CPU per example; a copy each / in step: {medians['in step, a copy each'] / in_step:.2f}x")


FORWARD_SIZES = (8, 16, 24)  # beside BATCH_LIMIT: what a smaller batch costs per example


@dataclass
class Forward:
    rate: float
    """examples/s"""
    cpu_us: float
    """the replicas' own threads' CPU per example (with one torch thread each: all of the forward's)"""


def _forward_rate(seconds: float, replicas: int, threads: int, batch: int = BATCH_LIMIT,
                  shared: bool = False, out_of_step: bool = False) -> Forward:
    import random
    import threading

    import torch

    from tandem.examples.digits import mlp

    torch.set_num_threads(threads)
    devices = [torch.device("cuda", i % torch.cuda.device_count()) if DEVICE == "cuda" else torch.device("cpu")
               for i in range(replicas)]
    shared = shared and len(set(devices)) == 1  # as the server: one copy per device
    models = [mlp(HIDDEN).eval().to(devices[0])] * replicas if shared else \
        [mlp(HIDDEN).eval().to(device) for device in devices]
    example = torch.from_numpy(np.tile(EXAMPLE, (batch, 1)))
    counts = [0] * replicas
    cpu = [0] * replicas
    stop = threading.Event()

    def run(index: int) -> None:
        started, pauses = time.thread_time_ns(), random.Random(index)
        with torch.no_grad():
            while not stop.is_set():  # as the server does: the batch to the device, the answer back to the host
                forward_started = time.perf_counter()
                models[index](example.to(devices[index])).cpu()
                counts[index] += 1
                if out_of_step:
                    time.sleep(pauses.uniform(0, time.perf_counter() - forward_started))
        cpu[index] = time.thread_time_ns() - started

    runners = [threading.Thread(target=run, args=(i,)) for i in range(replicas)]
    for runner in runners:
        runner.start()
    time.sleep(0.5)
    before, started = sum(counts), time.perf_counter()
    time.sleep(seconds)
    done, elapsed = sum(counts) - before, time.perf_counter() - started
    stop.set()
    for runner in runners:
        runner.join()
    forward = Forward(done * batch / elapsed, sum(cpu) / sum(counts) / batch / 1e3)
    # A replica's own thread's CPU: all of its forward's with one torch thread (with more, torch's others work too).
    cpu_per_example = f", {forward.cpu_us:.0f} us of CPU per example" if threads == 1 else ""
    sharing = " sharing one model" if shared and replicas > 1 else ""
    paused = ", out of step" if out_of_step else ""
    print(f"{'ceiling' if batch == BATCH_LIMIT else 'forward'}: raw forward in process, batch {batch}, {replicas} "
          f"replica(s) x {threads} thread(s){sharing}{paused}: {forward.rate:.0f} examples/s{cpu_per_example}",
          flush=True)
    return forward


WRK_CONNECTIONS = (8, 64, SATURATED)


@dataclass
class Point:
    """One load point on one server: the load generator's req/s, p99 and failures, and where the CPU went."""

    rate: float
    p99_ms: float
    mean_ms: float
    failed: int
    costs: Costs

    @property
    def past_output_ms(self) -> float:
        """The client's mean latency beyond the server's submit-to-output time: parsing and decoding before the
        submit, the hand-off to the event loop, encoding and writing the answer, both kernels' TCP and the client."""
        return self.mean_ms - self.costs.answered_ms


PAST_OUTPUT_HEADER = "client's mean latency past submit-to-output ms"
UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def run_wrk(server: Server, body: Path, connections: int, seconds: float, workers: int) -> Point:
    """wrk's req/s, p99 (ms) and failed responses (non-2xx, socket errors) over `seconds` after a 1 s warm-up, and
    the server's costs over the measured run."""
    wrk_warm_up(server.port, body, connections)
    with ServeCosts(server.process.pid, server.port, "mlp", BATCH_LIMIT, workers) as costs:
        rate, p99_ms, mean_ms, failed = wrk(server.port, body, connections, seconds)
    return Point(rate, p99_ms, mean_ms, failed, costs.result)


def wrk_body(directory: Path) -> Path:
    """The request wrk posts (bench/wrk_infer.lua), written into `directory`."""
    body = directory / "request.json"
    body.write_text(json.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                                            "data": EXAMPLE.tolist()}]}))
    return body


def _wrk_command(port: int, body: Path, connections: int, seconds: float) -> list[str]:
    return ["wrk", "-t1", f"-c{connections}", "--latency", "-s", str(ROOT / "bench" / "wrk_infer.lua"),
            f"-d{max(1, round(seconds))}s", f"http://{HOST}:{port}/v2/models/mlp/infer", "--", str(body)]


def wrk_warm_up(port: int, body: Path, connections: int) -> None:
    run_client(_wrk_command(port, body, connections, 1))


def wrk(port: int, body: Path, connections: int, seconds: float) -> tuple[float, float, float, int]:
    """wrk posting `body` for `seconds`: req/s, p99 and mean latency (ms), failed responses (non-2xx, socket
    errors)."""
    out = run_client(_wrk_command(port, body, connections, seconds), text=True).stdout
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    value, unit = re.search(r"^\s+99%\s+([\d.]+)(us|ms|s)$", out, re.M).groups()
    p99_ms = float(value) * UNIT_MS[unit]
    value, unit = re.search(r"^\s+Latency\s+([\d.]+)(us|ms|s)", out, re.M).groups()
    mean_ms = float(value) * UNIT_MS[unit]
    failed = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    failed += sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    return rate, p99_ms, mean_ms, failed


def run_loadgen(server: Server, request: bytes, connections: int, seconds: float, workers: int) -> Point:
    with ServeCosts(server.process.pid, server.port, "mlp", BATCH_LIMIT, workers, client="self") as costs:
        result = drive(server.port, request, connections, seconds)
    failed = sum(n for status, n in result.statuses.items() if status != 200)
    return Point(result.rps, result.p99, statistics.fmean(result.latencies_ms), failed, costs.result)


def bench_wrk(seconds: float, workers: int, directory: Path, against: str | None, rounds: int,
              processes: int = 1) -> None:
    """wrk and bench/loadgen.py at each point, `rounds` times; with `against` (a git ref), the server as it is at that
    ref too, or with processes > 1 the server as one process, alternating with this tree's (the order flips each
    round), and the ratios printed."""
    if shutil.which("wrk") is None:
        print("wrk: skipped: wrk is not installed (Debian: apt-get install wrk)")
        return
    body = wrk_body(directory)
    variants = _variants(against, directory, processes, workers)
    points: dict[tuple[str, str, int], list[Point]] = {}
    ceilings = []
    with contextlib.ExitStack() as running:
        servers = {variant.label: running.enter_context(tandem_server(
            "batched", workers, directory, variant.source, processes=variant.processes)) for variant in variants}
        for server in servers.values():
            drive(server.port, tandem_request(server.port), 8, 1.0, check_tandem)  # warm-up, with answers checked
        for round_ in range(rounds):
            for connections in WRK_CONNECTIONS:
                for client, run in (("wrk", run_wrk), ("loadgen", run_loadgen)):
                    for variant in _in_turn(variants, round_):
                        label, server = variant.label, servers[variant.label]
                        request = body if client == "wrk" else tandem_request(server.port)
                        point = run(server, request, connections, seconds, workers)
                        points.setdefault((label, client, connections), []).append(point)
                        print(f"{label}: {client:7s} c={connections:<3d} {point.rate:8.0f} req/s  p99 "
                              f"{point.p99_ms:6.1f} ms  failed {point.failed}\n    {point.costs.line()}", flush=True)
            ceilings.append(bench_ceiling(seconds, workers))
    ceiling = max(ceilings)
    for size in FORWARD_SIZES:
        _forward_rate(seconds / 2, workers, max(1, cores() // workers), size, shared=True)
    for label in (variant.label for variant in variants):
        best = {key: max(found, key=lambda p: p.rate) for key, found in points.items() if key[0] == label}
        print(f"\n{label} (best of {rounds} round(s)); the rows of bench/RESULTS.md's table:")
        print("| connections | wrk req/s (p99 ms) | wrk / ceiling | loadgen req/s (p99 ms) | loadgen / ceiling |")
        print("|---|---|---|---|---|")
        for connections in WRK_CONNECTIONS:
            wrk, python = best[label, "wrk", connections], best[label, "loadgen", connections]
            print(f"| {connections} | {_rate_cell(wrk)} | **{wrk.rate / ceiling:.2f}** | {_rate_cell(python)} | "
                  f"{python.rate / ceiling:.2f} |")
        print(_bound_line({f"wrk c={c}": best[label, "wrk", c] for c in WRK_CONNECTIONS}, ceiling))
        print(f"\n| client | connections | {COSTS_HEADER} | {PAST_OUTPUT_HEADER} |")
        print("|---|---|" + "---|" * (COSTS_HEADER.count("|") + 2))
        for client in ("wrk", "loadgen"):
            for connections in WRK_CONNECTIONS:
                point = best[label, client, connections]
                print(f"| {client} | {connections} | {point.costs.row()} | {point.past_output_ms:.1f} |")
    print(_ceiling_line(ceilings, workers))
    if len(variants) > 1:
        mine, other = (variant.label for variant in variants)
        print(f"\n{mine} / {other}, medians over {rounds} round(s) (req/s: higher is better; CPU per request: "
              "lower is better):")
        for client in ("wrk", "loadgen"):
            for connections in WRK_CONNECTIONS:
                ours, theirs = points[mine, client, connections], points[other, client, connections]
                print(f"  {client:7s} c={connections:<3d} req/s {_median_ratio(ours, theirs, lambda p: p.rate)}, "
                      f"p99 {_median_ratio(ours, theirs, lambda p: p.p99_ms)}, loop CPU "
                      f"{_median_ratio(ours, theirs, lambda p: p.costs.loop_us)}, workers' CPU "
                      f"{_median_ratio(ours, theirs, lambda p: sum(p.costs.workers_us))}, client CPU "
                      f"{_median_ratio(ours, theirs, lambda p: p.costs.client_us)}, mean batch "
                      f"{_median_ratio(ours, theirs, lambda p: p.costs.mean_batch)}")


@dataclass(frozen=True)
class Variant:
    """A server to measure: its label, the code it runs (None: this tree's) and its number of processes."""

    label: str
    source: Path | None
    processes: int


def _variants(against: str | None, directory: Path, processes: int, workers: int) -> list[Variant]:
    """The servers to measure: this tree's as `processes` processes; beside it the code at git ref `against` as
    many processes when given, else, with processes > 1, this tree's as one process of all the workers."""
    label = "this tree" if processes == 1 else f"{processes} processes x {max(1, workers // processes)} worker(s)"
    variants = [Variant(label, None, processes)]
    if against:
        variants.append(Variant(against, checkout(against, directory / "against"), processes))
    elif processes > 1:
        variants.append(Variant(f"1 process x {workers} workers", None, 1))
    return variants


def _in_turn(variants: list[Variant], round_: int) -> list[Variant]:
    """The order of a round's pairs: it flips each round, so that neither server always runs first. Both servers run
    for the whole benchmark and each point is measured on one then the other at once: the machine's speed drifts by
    10-30% over a minute on a shared 2-core VM, so only measurements taken seconds apart pair up."""
    return variants if round_ % 2 == 0 else variants[::-1]


def _ceiling_line(ceilings: list[float], workers: int) -> str:
    """The ceiling the ratios are taken against: the best of one measurement after each round, as the served figures
    are the best of the rounds (the machine's speed drifts by 10% within a run)."""
    measured = ", ".join(f"{ceiling:.0f}" for ceiling in ceilings)
    return (f"ceiling (raw forward, batch {BATCH_LIMIT}, {workers} replicas): {max(ceilings):.0f} examples/s, the best "
            f"of {len(ceilings)} measured after each round ({measured})")


def bound(point: Point, ceiling: float, client_shares_cores: bool) -> float:
    """The most the cores allow, as a share of the ceiling, at `point`'s measured costs per request (the event loops',
    the server's other threads' and, where it shares the servers' cores, the client's CPU) if the workers cost no
    more than the raw forward: the ceiling's CPU per example is cores / ceiling, so the cores answer at most
    cores / (cores / ceiling + the rest) requests a second. A target above this bound needs those costs cut, whatever
    the workers do."""
    rest_us = point.costs.loop_us + point.costs.other_us + (point.costs.client_us if client_shares_cores else 0.0)
    return _bound(rest_us, ceiling)


def _bound(rest_us: float, ceiling: float) -> float:
    return 1.0 / (1.0 + rest_us * ceiling / (cores() * 1e6))


def _bound_line(points: dict[str, Point], ceiling: float) -> str:
    shares = CLIENT_CPUS is None
    bounds = ", ".join(f"{name} {bound(point, ceiling, shares):.2f}" for name, point in points.items())
    client = "the loop's and the client's" if shares else "the loop's (the client on CPUs of its own)"
    return (f"bound with the workers at the raw forward's cost and {client} CPU per request as measured, share of "
            f"the ceiling: {bounds}")


def _rate_cell(point: Point) -> str:
    return f"{point.rate:.0f} ({point.p99_ms:.1f}){' failed ' + str(point.failed) if point.failed else ''}"


def _median_ratio(ours: list[Point], theirs: list[Point], value) -> str:
    """The median over rounds of ours / theirs, with the rounds' range where there are several."""
    ratios = [value(a) / value(b) for a, b in zip(ours, theirs, strict=True)]
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{statistics.median(ratios):.2f}x{spread}"


GRPC_CONNECTIONS = 8  # h2load's connections; the rest of each point's concurrency is streams on them


@dataclass
class CpuPoint:
    """One load point measured from outside alone (no statistics endpoint asked): wrk's figures and CPU per request."""

    rate: float
    p99_ms: float
    failed: int
    path_us: float
    """the processes' threads other than the workers: event loops, the C front's I/O threads, the rest"""
    workers_us: float
    client_us: float

    def line(self) -> str:
        return (f"{self.rate:8.0f} req/s  p99 {self.p99_ms:6.1f} ms  failed {self.failed}; CPU per request: request "
                f"path {self.path_us:.0f} us, workers {self.workers_us:.0f} us, wrk {self.client_us:.0f} us")


def bench_native(seconds: float, workers: int, directory: Path, rounds: int) -> None:
    """`tandem serve` with its ports read by the Python server and by the C front (httpFront native), both as
    `workers` processes of one worker, alternating under wrk (HTTP) and h2load (gRPC) at each point, the ceiling after
    each round: the share of the ceiling each keeps, where each request's CPU goes, and native / python."""
    loads = {}
    if shutil.which("wrk") is None:
        print("native: HTTP skipped: wrk is not installed (Debian: apt-get install wrk)")
    else:
        body = wrk_body(directory)
        loads["HTTP, wrk"] = lambda server, connections: _cpu_point(
            server, connections, seconds, workers, lambda: wrk(server.port, body, connections, seconds),
            lambda: wrk_warm_up(server.port, body, connections))
    if shutil.which("h2load") is None:
        print("native: gRPC skipped: h2load is not installed (Debian: apt-get install nghttp2-client)")
    else:
        request_file = grpc_request_file(directory)
        loads["gRPC, h2load"] = lambda server, concurrency: _cpu_point(
            server, concurrency, seconds, workers,
            lambda: _h2load_outside(server, request_file, concurrency, seconds, directory),
            lambda: h2load(server.grpc_port, request_file, concurrency, 1, directory))
    if not loads:
        return
    labels = ("python", "native")
    points: dict[tuple[str, str, int], list[CpuPoint]] = {}
    ceilings = []
    for round_ in range(rounds):
        for label in _in_turn(labels, round_):
            with tandem_server("batched", workers, directory, processes=workers, http_front=label,
                               grpc_port=free_port()) as server:
                check_grpc(server.grpc_port, grpc_request_file(directory))
                for load, measure in loads.items():
                    for connections in WRK_CONNECTIONS:
                        point = measure(server, connections)
                        points.setdefault((label, load, connections), []).append(point)
                        print(f"httpFront {label}: {load} c={connections:<3d} {point.line()}", flush=True)
        ceilings.append(bench_ceiling(seconds, workers))
    ceiling = max(ceilings)
    for load in loads:
        print(f"\n{load}: `tandem serve`, {workers} processes x 1 worker, best of {rounds} round(s); share of the "
              "ceiling (bound: with the workers at the raw forward's cost); CPU per request at the best round: request "
              "path (the processes' threads other than the workers) / workers / load generator")
        print("| connections | python front req/s (p99 ms) | share (bound) | us | native front req/s (p99 ms) | share "
              "(bound) | us | native / python, median of rounds |")
        print("|---|---|---|---|---|---|---|---|")
        for connections in WRK_CONNECTIONS:
            cells = []
            for label in labels:
                best = max(points[label, load, connections], key=lambda p: p.rate)
                rest = best.path_us + (best.client_us if CLIENT_CPUS is None else 0.0)
                cells.append(f"{best.rate:.0f} ({best.p99_ms:.1f}) | **{best.rate / ceiling:.2f}** "
                             f"({_bound(rest, ceiling):.2f}) | {best.path_us:.0f} / {best.workers_us:.0f} / "
                             f"{best.client_us:.0f}")
            ratios = [native.rate / python.rate for python, native
                      in zip(points[labels[0], load, connections], points[labels[1], load, connections], strict=True)]
            cells.append(f"{statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)})")
            print(f"| {connections} | {' | '.join(cells)} |")
    print(_ceiling_line(ceilings, workers))


def _cpu_point(server: Server, connections: int, seconds: float, workers: int, run, warm_up) -> CpuPoint:
    """One load point: `run()` -> (req/s, p99 ms, mean ms, failed) after `warm_up()`, with the CPU of the server's
    threads and of the load generator over it."""
    warm_up()
    pids = server_processes(server.process.pid)

    def threads() -> dict[int, tuple[float, float]]:
        return {tid: times for pid in pids for tid, times in thread_times(pid).items()}

    threads_before, client_before = threads(), children_cpu()
    rate, p99_ms, _, failed = run()
    threads_after, client = threads(), children_cpu() - client_before
    loop, busiest, other, _ = split_threads(threads_before, threads_after, pids, workers)
    per_request = 1e6 / max(1.0, rate * max(1, round(seconds)))
    return CpuPoint(rate, p99_ms, failed, (loop + other) * per_request, sum(busiest) * per_request,
                    client * per_request)


def _h2load_outside(server: Server, request_file: Path, concurrency: int, seconds: float,
                    directory: Path) -> tuple[float, float, float, int]:
    """h2load's figures, with the calls not answered OK counted from the server's successes, read before and after
    (outside the measured run): h2load sees only HTTP statuses, 200 for a failed call too. (Not from its failures:
    the calls h2load resets when its time is up count there.)"""
    before = _successful_inferences(server.port)
    rate, p99_ms, mean_ms, done = h2load(server.grpc_port, request_file, concurrency, seconds, directory)
    return rate, p99_ms, mean_ms, max(0, done - (_successful_inferences(server.port) - before))


def _successful_inferences(port: int) -> int:
    """The served model's successful inference requests so far (its statistics)."""
    with urllib.request.urlopen(f"http://{HOST}:{port}/v2/models/mlp/stats", timeout=30) as answer:
        return int(json.load(answer)["model_stats"][0]["inference_stats"]["success"]["count"])


def grpc_request_file(directory: Path) -> Path:
    """The ModelInferRequest of one example (raw FP32 contents, as tritonclient.grpc sends it) as gRPC puts it on the
    wire: a 0 byte (not compressed), its length (4 bytes, big-endian), the message."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="mlp", raw_input_contents=[EXAMPLE.reshape(1, 64).tobytes()])
    request.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    message = request.SerializeToString()
    path = directory / "request.grpc"
    path.write_bytes(b"\0" + len(message).to_bytes(4, "big") + message)
    return path


def check_grpc(port: int, request_file: Path) -> None:
    """Send the bytes h2load will send through a gRPC client and check the answer (status OK, 10 outputs): h2load
    itself only sees HTTP statuses, which are 200 even for a failed call (gRPC's status is in the trailers)."""
    import grpc
    from tritonclient.grpc import service_pb2

    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None,
                                    response_deserializer=service_pb2.ModelInferResponse.FromString)
        answer = infer(request_file.read_bytes()[5:], timeout=30)
    if len(answer.raw_output_contents) != 1 or len(answer.raw_output_contents[0]) != 10 * 4:
        raise AssertionError(f"unexpected gRPC answer: {answer}")


def h2load(grpc_port: int, request_file: Path, concurrency: int, seconds: float,
           directory: Path) -> tuple[float, float, float, int]:
    """h2load posting `request_file` at `concurrency` calls for `seconds`: req/s, p99 and mean ms (from its
    per-request log), and the calls done."""
    connections = min(concurrency, GRPC_CONNECTIONS)
    log = directory / f"h2load-{concurrency}.log"
    command = ["h2load", "-t1", f"-c{connections}", f"-m{concurrency // connections}", "-d", str(request_file),
               "-H", "content-type: application/grpc", "-H", "te: trailers", "-D", str(max(1, round(seconds))),
               "--log-file", str(log), f"http://{HOST}:{grpc_port}/inference.GRPCInferenceService/ModelInfer"]
    out = run_client(command, text=True).stdout
    rate = float(re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out).group(1))
    durations = sorted(int(line.split("\t")[2]) for line in log.read_text().splitlines() if line.strip())
    p99_ms = durations[min(len(durations) - 1, int(0.99 * len(durations)))] / 1000
    done = int(re.search(r"requests: \d+ total, \d+ started, (\d+) done", out).group(1))
    return rate, p99_ms, statistics.fmean(durations) / 1000, done


def run_h2load(server: Server, grpc_port: int, request_file: Path, concurrency: int, seconds: float,
               workers: int, directory: Path) -> Point:
    """h2load's figures over `seconds` after a 1 s warm-up. Failed calls are counted by the server (its failure and
    success counters over the run), not by h2load (see check_grpc)."""
    h2load(grpc_port, request_file, concurrency, 1, directory)  # warm-up
    with ServeCosts(server.process.pid, server.port, "mlp", BATCH_LIMIT, workers) as costs:
        rate, p99_ms, mean_ms, done = h2load(grpc_port, request_file, concurrency, seconds, directory)
    failed = done - costs.result.requests if costs.result.requests < done else 0
    return Point(rate, p99_ms, mean_ms, failed, costs.result)


def bench_grpc(seconds: float, workers: int, directory: Path, against: str | None, rounds: int,
               processes: int = 1) -> None:
    """h2load at each point, `rounds` times; with `against` (a git ref) or processes > 1, a second server as for
    bench_wrk, alternating with this tree's, and the ratios printed."""
    if shutil.which("h2load") is None:
        print("grpc: skipped: h2load is not installed (Debian: apt-get install nghttp2-client)")
        return
    request_file = grpc_request_file(directory)
    variants = _variants(against, directory, processes, workers)
    points: dict[tuple[str, int], list[Point]] = {}
    ceilings = []
    with contextlib.ExitStack() as running:
        servers = {variant.label: running.enter_context(tandem_server(
            "batched", workers, directory, variant.source, grpc_port=free_port(), processes=variant.processes))
            for variant in variants}
        for server in servers.values():
            check_grpc(server.grpc_port, request_file)
        for round_ in range(rounds):
            for concurrency in WRK_CONNECTIONS:
                for variant in _in_turn(variants, round_):
                    label, server = variant.label, servers[variant.label]
                    point = run_h2load(server, server.grpc_port, request_file, concurrency, seconds, workers,
                                       directory)
                    points.setdefault((label, concurrency), []).append(point)
                    print(f"{label}: h2load  c={concurrency:<3d} {point.rate:8.0f} req/s  p99 {point.p99_ms:6.1f} ms  "
                          f"not answered OK {point.failed}\n    {point.costs.line()}", flush=True)
            ceilings.append(bench_ceiling(seconds, workers))
    ceiling = max(ceilings)
    for label in (variant.label for variant in variants):
        best = {concurrency: max(points[label, concurrency], key=lambda p: p.rate) for concurrency in WRK_CONNECTIONS}
        print(f"\n{label}: gRPC (h2load, {GRPC_CONNECTIONS} connections, streams on them for the rest; best of "
              f"{rounds} round(s)); the rows of bench/RESULTS.md's table:")
        print("| concurrent calls | h2load req/s (p99 ms) | h2load / ceiling |")
        print("|---|---|---|")
        for concurrency, point in best.items():
            print(f"| {concurrency} | {_rate_cell(point)} | **{point.rate / ceiling:.2f}** |")
        print(_bound_line({f"h2load c={c}": point for c, point in best.items()}, ceiling))
        print(f"\n| concurrent calls | {COSTS_HEADER} | {PAST_OUTPUT_HEADER} |")
        print("|---|" + "---|" * (COSTS_HEADER.count("|") + 2))
        for concurrency, point in best.items():
            print(f"| {concurrency} | {point.costs.row()} | {point.past_output_ms:.1f} |")
    print(_ceiling_line(ceilings, workers))
    if len(variants) > 1:
        mine, other = (variant.label for variant in variants)
        print(f"\n{mine} / {other}, medians over {rounds} round(s) (req/s: higher is better; CPU per call: "
              "lower is better):")
        for concurrency in WRK_CONNECTIONS:
            ours, theirs = points[mine, concurrency], points[other, concurrency]
            print(f"  h2load c={concurrency:<3d} req/s {_median_ratio(ours, theirs, lambda p: p.rate)}, "
                  f"p99 {_median_ratio(ours, theirs, lambda p: p.p99_ms)}, loop CPU "
                  f"{_median_ratio(ours, theirs, lambda p: p.costs.loop_us)}, workers' CPU "
                  f"{_median_ratio(ours, theirs, lambda p: sum(p.costs.workers_us))}, client CPU "
                  f"{_median_ratio(ours, theirs, lambda p: p.costs.client_us)}, mean batch "
                  f"{_median_ratio(ours, theirs, lambda p: p.costs.mean_batch)}")


def litserve_server(workers: int, batch_timeout: float, fast_queue: bool) -> Server:
    port = free_port()
    threads = max(1, cores() // workers)
    script = Path(__file__).resolve().parent / "litserve_mlp.py"
    arguments = [HIDDEN, BATCH_LIMIT, workers, batch_timeout, threads, port, 1 if fast_queue else 0]
    return Server([sys.executable, str(script), *map(str, arguments)], port, "/health")


def check_litserve(body: bytes) -> None:
    if len(orjson.loads(body)["output"]) != 10:
        raise AssertionError(body[:200])


def bench_litserve(seconds: float, workers: int, tandem: dict[tuple[str, int], LoadResult] | None) -> None:
    # LitServe's knobs that matter here, each tried; its best result at each concurrency is the one compared.
    configs = [(workers, 0.001, False), (workers, 0.005, False), (workers, 0.005, True), (workers, 0.02, True)]
    if workers != 1:
        configs.append((1, 0.005, True))
    best: dict[int, tuple[LoadResult, str]] = {}
    for lit_workers, batch_timeout, fast_queue in configs:
        label = f"workers_per_device={lit_workers} batch_timeout={batch_timeout} fast_queue={fast_queue}"
        with litserve_server(lit_workers, batch_timeout, fast_queue) as server:
            body = orjson.dumps({"input": EXAMPLE.tolist()})
            request = build_request(HOST, server.port, "/predict", body, {"Content-Type": "application/json"})
            drive(server.port, request, 8, 1.0, check_litserve)
            for concurrency in (8, 64):
                result = drive(server.port, request, concurrency, seconds)
                print(f"litserve {label} c={concurrency:<3d} {result.line()}", flush=True)
                if concurrency not in best or result.rps > best[concurrency][0].rps:
                    best[concurrency] = (result, label)
    if tandem is None:
        return
    for concurrency in (8, 64):
        ours, (theirs, label) = tandem["batched", concurrency], best[concurrency]
        print(f"tandem batched / litserve ({label}) at c={concurrency}: {ours.rps / theirs.rps:.2f}x throughput; "
              f"p99 {ours.p99:.1f} ms vs {theirs.p99:.1f} ms")


def main() -> None:
    global HIDDEN, DEVICE, WRK_CONNECTIONS  # the model size, device and load points every part below uses
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per point (after 0.5 s warm-up)")
    parser.add_argument("--workers", type=int, help="model replicas (default: one per core the servers run on)")
    parser.add_argument("--only", choices=("modes", "ceiling", "step", "litserve", "wrk", "grpc", "native"),
                        action="append")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help=f"the MLP's hidden units (default {HIDDEN})")
    parser.add_argument("--against", metavar="GIT_REF",
                        help="wrk, grpc: also serve the code as it is at this git ref, alternating with this tree's, "
                             "and print this tree's figures over its")
    parser.add_argument("--processes", type=int, default=1,
                        help="wrk, grpc: serve as this many processes of workers/N workers each (processesPerReplica), "
                             "beside one process of all the workers (or the --against ref as as many processes)")
    parser.add_argument("--connections", metavar="LIST", default=",".join(map(str, WRK_CONNECTIONS)),
                        help="wrk, grpc: the load points, connections (concurrent calls over gRPC), e.g. 256 or "
                             "64,256: fewer points, more rounds in the same time")
    parser.add_argument("--rounds", type=int, default=1,
                        help="wrk, grpc: rounds over every point (best one tabled); step: rounds (at least 3)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one replica per GPU in the server (gpusPerReplica 1) and in the ceiling")
    parser.add_argument("--client-cpus", metavar="LIST",
                        help="run the load generators on these CPUs (e.g. 1 or 2,3) and the servers and the ceiling "
                             "on the others this process may use, so that the client's CPU is out of the comparison")
    args = parser.parse_args()
    HIDDEN, DEVICE = args.hidden, args.device
    WRK_CONNECTIONS = _connections(args.connections)
    if args.client_cpus:
        _split_cpus(args.client_cpus)
    args.workers = args.workers or cores()
    parts = args.only or ["modes", "ceiling", "litserve"]
    clients = "" if CLIENT_CPUS is None else f" (the servers' and the ceiling's; clients on CPUs {sorted(CLIENT_CPUS)})"
    print(f"model: digits MLP, hidden {HIDDEN}; {cores()} cores{clients}; {args.workers} worker(s) on {DEVICE}; "
          f"batchLimit {BATCH_LIMIT}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tandem = bench_modes(args.seconds, args.workers, Path(tmp)) if "modes" in parts else None
    if "ceiling" in parts:
        ceiling = bench_ceiling(args.seconds, args.workers)
        if tandem is not None:
            for concurrency in (64, SATURATED):
                served = tandem["batched", concurrency].rps
                print(f"server (batched, c={concurrency}) / raw in-process ceiling: {served:.0f} / {ceiling:.0f} = "
                      f"{served / ceiling:.2f}")
    if "step" in parts:
        bench_step(args.seconds, args.workers, max(args.rounds, 3))
    if "litserve" in parts:
        bench_litserve(args.seconds, args.workers, tandem)
    if "wrk" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            bench_wrk(args.seconds, args.workers, Path(tmp), args.against, args.rounds, args.processes)
    if "native" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            bench_native(args.seconds, args.workers, Path(tmp), args.rounds)
    if "grpc" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            bench_grpc(args.seconds, args.workers, Path(tmp), args.against, args.rounds, args.processes)


def _listed_numbers(listed: str, option: str, what: str, least: int | None = None) -> list[int]:
    """The integers of a comma-separated option value, each at least `least` when given; SystemExit naming `option`
    and `what` (with an example) otherwise."""
    try:
        numbers = [int(number) for number in listed.split(",")]
    except ValueError:
        numbers = []
    if not numbers or (least is not None and min(numbers) < least):
        raise SystemExit(f"{option}: {listed!r} is not a comma-separated list of {what}")
    return numbers


def _connections(listed: str) -> tuple[int, ...]:
    return tuple(_listed_numbers(listed, "--connections", "positive counts (e.g. 256 or 64,256)", least=1))


def _split_cpus(listed: str) -> None:
    """The load generators on the CPUs `listed`; this process's main thread, and so the servers it starts and the
    ceiling's threads, on the rest."""
    global CLIENT_CPUS
    clients = set(_listed_numbers(listed, "--client-cpus", "CPU numbers (e.g. 1 or 2,3)"))
    own = os.sched_getaffinity(0)
    if not clients < own:
        raise SystemExit(f"--client-cpus: {sorted(clients)} must be some, not all, of the CPUs this process may use "
                         f"({sorted(own)})")
    CLIENT_CPUS = clients
    os.sched_setaffinity(0, own - clients)


if __name__ == "__main__":
    main()
