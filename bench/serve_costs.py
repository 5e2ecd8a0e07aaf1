"""Where a served request's time goes, measured from outside the server while a load generator drives it: the CPU
time each thread of the server process spends per answered request (its event loop thread, its inference workers,
the rest), the load generator's own CPU per request, the batch sizes the server formed and how long requests
waited in its queue (from its statistics endpoint, `GET /v2/models/{m}/stats`).

    with ServeCosts(server_pid, port, "mlp") as costs:
        ... drive the server ...
    print(costs.result.line())          # after the block: the deltas over it

Threads are told apart by what Linux reports (/proc/PID/task/TID/schedstat: time on a CPU, time runnable but
waiting for one): the event loop runs on the process's main thread (TID == PID); the inference workers are the
busiest other threads, `workers` of them. A `tandem serve --processes N` supervisor serves nothing itself: its
children are measured instead, their event loops summed, and `workers` counts the workers of all of them. A
worker's wall time that is neither is time it was blocked: waiting for
the GIL or a lock, or for work.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass


def thread_times(pid: int) -> dict[int, tuple[float, float]]:
    """Seconds on a CPU and seconds runnable but waiting for one, of each thread of process `pid`, by thread id."""
    times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as schedstat:
                running, waiting = schedstat.read().split()[:2]
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        times[int(tid)] = (int(running) / 1e9, int(waiting) / 1e9)
    return times


def server_processes(pid: int) -> list[int]:
    """The processes that serve for `pid`: its children when it has any (a supervisor's), else itself."""
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [int(child) for child in children.read().split()] or [pid]


def children_cpu() -> float:
    """CPU seconds of this process's waited-for children (a load generator run with subprocess.run)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def candidate_server(script: str, stack: str, port: int) -> Iterator[subprocess.Popen]:
    """`script --serve STACK --port PORT` in a process of its own (a stack benchmark's candidate), stopped on
    leaving."""
    server = subprocess.Popen([sys.executable, script, "--serve", stack, "--port", str(port)])
    try:
        yield server
    finally:
        server.terminate()
        server.wait(timeout=30)
        time.sleep(0.5)


def cpu_per_call(pid: int, before: float, calls: int) -> float:
    """Process `pid`'s CPU microseconds per call over `calls` calls since `before` (its process_cpu then)."""
    return (process_cpu(pid) - before) / max(1, calls) * 1e6


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def model_stats(port: int, model: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}/stats", timeout=30) as answer:
        return json.load(answer)["model_stats"][0]


@dataclass
class Costs:
    """Per answered request over a measured span: microseconds of CPU and milliseconds of waiting."""

    requests: int
    loop_us: float
    workers_us: list[float]
    workers_blocked_us: float
    """The workers' wall time neither on a CPU nor waiting for one (the GIL, locks, no work), summed."""
    workers_runnable_us: float
    """The workers' time runnable but waiting for a CPU (other threads and processes on the cores), summed."""
    other_us: float
    client_us: float
    mean_batch: float
    full_share: float
    """The share of examples that ran in batches of batch_limit."""
    queue_ms: float
    """Mean time from submit to the start of the request's forward."""
    forward_us_per_example: float
    """Wall time of the forwards (infer only) per example."""
    answered_ms: float
    """Mean time from submit to the output being split off its batch (before the hand-off to the event loop)."""

    def line(self) -> str:
        workers = " + ".join(f"{w:.0f}" for w in self.workers_us)
        return (f"CPU per request: loop {self.loop_us:.0f} us, workers {workers} = {sum(self.workers_us):.0f} us, "
                f"other threads {self.other_us:.0f} us, client {self.client_us:.0f} us; workers blocked "
                f"{self.workers_blocked_us:.0f} us, waiting for a CPU {self.workers_runnable_us:.0f} us; batches: mean "
                f"{self.mean_batch:.1f}, {self.full_share:.0%} of examples in full ones, forward "
                f"{self.forward_us_per_example:.0f} us wall per example; queue wait {self.queue_ms:.2f} ms; "
                f"submit to output {self.answered_ms:.2f} ms")

    def row(self) -> str:
        """The breakdown as a row of RESULTS.md's table (after the label columns)."""
        return (f"{self.loop_us:.0f} | {sum(self.workers_us):.0f} | {self.workers_blocked_us:.0f} | "
                f"{self.workers_runnable_us:.0f} | {self.other_us:.0f} | {self.client_us:.0f} | "
                f"{self.mean_batch:.1f} ({self.full_share:.0%}) | {self.queue_ms:.1f} | {self.answered_ms:.1f}")


COSTS_HEADER = ("loop CPU us/req | workers' CPU us/req | workers blocked us/req | workers waiting for a CPU us/req | "
                "other threads' CPU | client CPU us/req | mean batch (share of examples in full batches) | "
                "queue wait ms | submit to output ms")


class ServeCosts:
    """Measures the server `pid` (answering on `port`) over the `with` block; `client` says whose CPU the load
    generator's is: "children" (a subprocess run to its end inside the block) or "self" (this process)."""

    def __init__(self, pid: int, port: int, model: str, batch_limit: int, workers: int, client: str = "children"):
        self.pid, self.port, self.model, self.batch_limit, self.workers = pid, port, model, batch_limit, workers
        self.client = children_cpu if client == "children" else own_cpu
        self.result: Costs | None = None

    def __enter__(self) -> ServeCosts:
        self.pids = server_processes(self.pid)
        self._stats, self._threads, self._client = model_stats(self.port, self.model), self._thread_times(), \
            self.client()
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        wall = time.perf_counter() - self._started
        client, threads, stats = self.client(), self._thread_times(), model_stats(self.port, self.model)
        self.result = costs(self._stats, stats, self._threads, threads, self.pids, client - self._client,
                            self.batch_limit, self.workers, wall)

    def _thread_times(self) -> dict[int, tuple[float, float]]:
        return {tid: times for pid in self.pids for tid, times in thread_times(pid).items()}


def split_threads(threads_before: dict[int, tuple[float, float]], threads_after: dict[int, tuple[float, float]],
                  pids: list[int], workers: int) -> tuple[float, list[float], float, float]:
    """CPU seconds between two `thread_times` of processes `pids`: their main threads' (event loops) summed, the
    `workers` busiest other threads' (the workers) busiest first, the rest's summed; and the seconds the workers
    were runnable but waiting for a CPU."""
    used = {tid: (running - threads_before.get(tid, (0.0, 0.0))[0], waiting - threads_before.get(tid, (0.0, 0.0))[1])
            for tid, (running, waiting) in threads_after.items()}
    loop = sum(used.pop(pid, (0.0, 0.0))[0] for pid in pids)
    ranked = sorted(used.values(), reverse=True)
    return (loop, [running for running, _ in ranked[:workers]], sum(running for running, _ in ranked[workers:]),
            sum(waiting for _, waiting in ranked[:workers]))


def costs(stats_before: dict, stats_after: dict, threads_before: dict[int, tuple[float, float]],
          threads_after: dict[int, tuple[float, float]], pids: list[int], client_seconds: float, batch_limit: int,
          workers: int, wall: float) -> Costs:
    def delta(key: str, field: str) -> int:
        return stats_after["inference_stats"][key][field] - stats_before["inference_stats"][key][field]

    requests = max(1, delta("success", "count"))
    per_request = 1e6 / requests
    loop, busiest, other, runnable = split_threads(threads_before, threads_after, pids, workers)
    before = {entry["batch_size"]: entry["compute_infer"] for entry in stats_before["batch_stats"]}
    forwards = examples = full = infer_ns = 0
    for entry in stats_after["batch_stats"]:
        size, infer = entry["batch_size"], entry["compute_infer"]
        count = infer["count"] - before.get(size, {"count": 0})["count"]
        forwards += count
        examples += count * size
        full += count * size if size == batch_limit else 0
        infer_ns += infer["ns"] - before.get(size, {"ns": 0})["ns"]
    return Costs(
        requests=requests, loop_us=loop * per_request, workers_us=[s * per_request for s in busiest],
        workers_blocked_us=(wall * workers - sum(busiest) - runnable) * per_request,
        workers_runnable_us=runnable * per_request,
        other_us=other * per_request, client_us=client_seconds * per_request,
        mean_batch=examples / max(1, forwards), full_share=full / max(1, examples),
        queue_ms=delta("queue", "ns") / max(1, delta("queue", "count")) / 1e6,
        forward_us_per_example=infer_ns / max(1, examples) / 1e3,
        answered_ms=delta("success", "ns") / requests / 1e6)
