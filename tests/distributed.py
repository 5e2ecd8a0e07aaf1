"""Run a function on N real torch.distributed ranks: one process each, on loopback, for tests.

    results = run_on_ranks(check_something, 3.0, world_size=2)   # check_something(rank, 3.0) on each rank

Like torchrun, the parent hosts the rendezvous TCPStore (on a free port the OS picks, so parallel test runs
never race for a port) and every rank gets the worker contract's torchrun variables (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus TORCHELASTIC_USE_AGENT_STORE, so that an
``init_process_group(init_method="env://")`` inside the ranks joins that store. By default the helper
initialises the process group itself (with ``group_timeout``, so a collective that never completes fails
instead of hanging) and destroys it afterwards; pass ``init_group=False`` to test code that does its own.

The ranks are forked from multiprocessing's fork server, which imports torch once for the session: a spawned rank
would import torch again, about 2 s a rank on two busy cores. Each rank starts from the server's fresh imports,
never from the test process's state, and gets the caller's environment and working directory as a spawned one
would. `fn` must be importable by the ranks (a module-level function of a test
module), and its arguments and return values picklable. The first rank that raises, or dies, fails the whole run
with that rank's traceback; the other ranks are then stopped. Every rank runs with torch.set_num_threads(1).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.worker.train.process_group import shutdown_process_group

LOOPBACK = "127.0.0.1"
_POLL_SECONDS = 0.2
_CONTEXT = multiprocessing.get_context("forkserver")
# What this module imports, by names the fork server finds (Python 3.11's does not take the caller's sys.path, which
# holds tests/; an import it cannot do is skipped silently, and every rank would then import torch itself).
_CONTEXT.set_forkserver_preload(["torch.distributed", "tandem.worker.train.process_group"])
_STOP_GRACE_SECONDS = 5.0


class RankFailed(RuntimeError):
    """A rank raised or died; the message holds its traceback."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str = "gloo",
    timeout: float = 120.0,
    group_timeout: float = 60.0,
    init_group: bool = True,
) -> list[Any]:
    """Call fn(rank, *args) on world_size ranks; return their return values in rank order.

    Raises RankFailed for the first rank that raises or exits without returning, and TimeoutError when the
    ranks have not all returned within `timeout` seconds (a deadlock, say).
    """
    store = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)
    results = _CONTEXT.Queue()
    processes = []
    try:
        for rank in range(world_size):
            environment = {
                **os.environ,
                "RANK": str(rank), "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(store.port),
                "TORCHELASTIC_USE_AGENT_STORE": str(True),
            }
            process = _CONTEXT.Process(
                target=_rank_main,
                args=(fn, args, rank, environment, backend, group_timeout, init_group, results),
                name=f"rank-{rank}",
            )
            process.start()
            processes.append(process)
        return _collect(processes, results, timeout)
    finally:
        _stop(processes)
        results.close()


def _rank_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    environment: dict[str, str],
    backend: str,
    group_timeout: float,
    init_group: bool,
    results: multiprocessing.Queue,
) -> None:
    os.environ.clear()  # the fork server's environment is the caller's when the server started, not now
    os.environ.update(environment)
    torch.set_num_threads(1)
    try:
        if init_group:
            dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=group_timeout))
        value = fn(rank, *args)
    except BaseException:
        results.put(pickle.dumps((rank, False, traceback.format_exc())))
        return
    finally:
        if init_group and dist.is_initialized():
            shutdown_process_group()
    # Plain pickle, by value: torch makes the queue's own pickler pass tensors as shared-memory handles,
    # which die with this process.
    results.put(pickle.dumps((rank, True, value)))


def _collect(processes: list, results: multiprocessing.Queue, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    while len(values) < len(processes):
        try:
            rank, ok, value = pickle.loads(results.get(timeout=_POLL_SECONDS))
        except queue.Empty:
            _check_alive(processes, values, results)
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(processes))) - values.keys())
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s") from None
            continue
        if not ok:
            raise _failure(rank, value, processes, values)
        values[rank] = value
    return [values[rank] for rank in range(len(processes))]


def _check_alive(processes: list, values: dict[int, Any], results: multiprocessing.Queue) -> None:
    """Fail for a rank that exited without reporting (after one last look for its report)."""
    for rank, process in enumerate(processes):
        if rank not in values and process.exitcode is not None:
            try:
                reported_rank, ok, value = pickle.loads(results.get(timeout=_POLL_SECONDS))
            except queue.Empty:
                raise RankFailed(rank, f"exited with code {process.exitcode} without returning") from None
            if not ok:
                raise _failure(reported_rank, value, processes, values)
            values[reported_rank] = value


def _failure(rank: int, detail: str, processes: list, values: dict[int, Any]) -> RankFailed:
    """The failure of `rank`, naming the ranks that died without a report: often the cause of its error."""
    silent = [
        f"rank {other} exited with code {process.exitcode} without reporting"
        for other, process in enumerate(processes)
        if other != rank and other not in values and process.exitcode not in (None, 0)
    ]
    return RankFailed(rank, "\n".join([detail.rstrip(), *silent]))


def _stop(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(_STOP_GRACE_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()
