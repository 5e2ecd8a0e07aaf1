"""The event loop's CPU time per HTTP inference request, without sockets and without the model's cost: a real
`tandem serve` process path (InferenceServer.run: its process-wide tuning, uvloop, the batching engine and its worker
threads, a small digits MLP) driven by in-process connections through the server's own HTTP protocol object, each
sending the next JSON request as soon as the previous answer is written (closed loop). What is measured is the CPU
time of the loop's thread per answered request (time.thread_time): parsing, routing, decoding, the hand-off to the
workers and back, encoding, writing to a transport that only counts; what is left out is the kernel's TCP work and
uvloop's socket code (about a quarter of the loop's time under wrk, bench/RESULTS.md).

Why: on a machine shared with other work, req/s and even CPU per request under wrk move by more than a change to the
loop's code does (other processes' load slows the same instructions down). With --against REF the server as it is at
git REF runs at the same moment in a second process, so both see the same load; the lowest rounds of each are
compared. Its resolution is a few percent: an A/A run (`--against HEAD`, 4 pairs) gave 0.90-0.98, median 0.96 (this
tree's process, imported from the working tree, ran a little faster than the checkout's).

    .venv/bin/python bench/bench_loop.py                              # this tree: CPU per request at 256 connections
    .venv/bin/python bench/bench_loop.py --against main --repeats 3   # both at once, 3 times: this tree / main
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_inference import EXAMPLE, checkout  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
POOL = {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool", "metadata": {"name": "mlp"},
        "spec": {"model": {"callable": "tandem.examples.digits:mlp", "args": {"hidden": 32}, "inputShape": [64]},
                 "inferenceMode": "batched", "workersPerReplica": 2, "batchLimit": 32, "queueLimit": 1024}}
BODY = orjson.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": EXAMPLE.tolist()}]})
REQUEST = (b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY


class CountingTransport:
    """What a connection writes to: counts answers, and has its connection receive the next request."""

    def __init__(self, run: Round):
        self.run = run
        self.connection = None

    def write(self, data: bytes) -> None:
        self.run.answered(self.connection, data)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


class Round:
    """`total` requests over `connections` connections; `done` resolves when every one is answered."""

    def __init__(self, http_server, connections: int, total: int):
        from tandem.worker.serve.http import _Connection

        self.loop = asyncio.get_running_loop()
        self.total, self.sent, self.answers, self.failed = total, 0, 0, 0
        self.done = self.loop.create_future()
        self.connections = []
        for _ in range(connections):
            connection = _Connection(http_server)
            transport = CountingTransport(self)
            transport.connection = connection
            connection.connection_made(transport)
            self.connections.append(connection)

    def start(self) -> None:
        for connection in self.connections:
            self.send(connection)

    def send(self, connection) -> None:
        self.sent += 1
        self.loop.call_soon(connection.data_received, REQUEST)

    def answered(self, connection, data: bytes) -> None:
        self.answers += 1
        if data[9:12] != b"200":
            self.failed += 1
        if self.sent < self.total:
            self.send(connection)
        elif self.answers == self.total and not self.done.done():
            self.done.set_result(None)


async def drive(server, connections: int, requests: int, rounds: int) -> None:
    while not server.ready:
        await asyncio.sleep(0.05)
    for _ in range(rounds):
        run = Round(server._http, connections, requests)
        started = time.thread_time()
        run.start()
        await run.done
        cpu = time.thread_time() - started
        for connection in run.connections:
            connection.connection_lost(None)
        if run.failed:
            raise SystemExit(f"{run.failed} requests failed")
        print(f"loop_us {cpu / requests * 1e6:.2f}", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # tandem serve's way out: drain and stop


def serve_and_drive(connections: int, requests: int, rounds: int) -> None:
    """One measuring process: the server as `tandem serve` runs it, and the load on its own event loop."""
    from tandem.api.inference import InferencePool
    from tandem.worker.serve.app import InferenceServer
    from tandem.worker.serve.background import new_event_loop

    server = InferenceServer(InferencePool.model_validate(POOL))

    async def main() -> None:
        load = asyncio.create_task(drive(server, connections, requests, rounds))
        await server.run("127.0.0.1", 0)
        await load

    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(main())


def measure(source: Path | None, args: argparse.Namespace) -> subprocess.Popen:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--connections", str(args.connections),
               "--requests", str(args.requests), "--rounds", str(args.rounds)]
    environment = {**os.environ, "PYTHONPATH": str(source)} if source else None
    return subprocess.Popen(command, cwd=source.parent / "source" if source else ROOT, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def lowest(process: subprocess.Popen, keep: int) -> list[float]:
    output, _ = process.communicate()
    if process.returncode:
        raise SystemExit(f"a measuring process failed (exit {process.returncode}): {output[-2000:]}")
    return sorted(float(line.split()[1]) for line in output.splitlines() if line.startswith("loop_us"))[:keep]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=256)
    parser.add_argument("--requests", type=int, default=6000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=12, help="rounds per process (the lowest 3 are kept)")
    parser.add_argument("--against", metavar="GIT_REF", help="run the server at GIT_REF at the same time, and compare")
    parser.add_argument("--repeats", type=int, default=1, help="with --against: pairs of processes, one after another")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        serve_and_drive(args.connections, args.requests, args.rounds)
        return
    with tempfile.TemporaryDirectory(prefix="bench-loop-") as directory:
        other = checkout(args.against, Path(directory)) if args.against else None
        ratios = []
        for repeat in range(args.repeats if other else 1):
            if repeat % 2:  # which process starts first alternates: an A/A run (--against HEAD) showed a bias of ~2%
                theirs = measure(other, args)
                ours = measure(None, args)
            else:
                ours = measure(None, args)
                theirs = measure(other, args) if other else None
            mine = lowest(ours, 3)
            line = f"this tree: event loop CPU per request {statistics.median(mine):.1f} us (lowest rounds {mine})"
            if theirs is not None:
                base = lowest(theirs, 3)
                ratios.append(statistics.median(mine) / statistics.median(base))
                line += f"; {args.against}: {statistics.median(base):.1f} us ({base}); ratio {ratios[-1]:.3f}"
            print(line, flush=True)
        if ratios:
            print(f"this tree / {args.against}, {args.connections} connections: event loop CPU per request "
                  f"{statistics.median(ratios):.3f}x (median of {len(ratios)})")


if __name__ == "__main__":
    main()
