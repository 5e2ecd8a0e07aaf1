"""ParallelInference's model replicas: a deep copy of the model per device, shared by the workers on it, warmed up
at every batch size in use, and one forward on a replica, checked for what ParallelInference serves (one tensor with
a row per example); `run_batch` runs a batch of requests through one and answers them."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tandem.worker.serve.batching import Ticket, join_inputs, split_output
from tandem.worker.serve.errors import ModelError
from tandem.worker.serve.stats import InferenceStats, batch_sizes


def default_devices(workers: int) -> list[torch.device]:
    """One replica per CUDA device (round robin when workers exceed devices), else all on the CPU."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return [torch.device("cuda", i % count) for i in range(workers)]
    return [torch.device("cpu")] * workers


def warmup_sizes(mode: str, batch_limit: int, example_rows: int = 1) -> list[int]:
    """Batch sizes a mode will run: batched mode any of 1..batch_limit (warmed at powers of two and the limit);
    sequential and inplace the sizes callers send."""
    if mode != "batched":
        return sorted({1, example_rows})
    return batch_sizes(batch_limit)


def build_replicas(model: torch.nn.Module, devices: Sequence[torch.device], example: torch.Tensor | None,
                   sizes: Sequence[int]) -> list[torch.nn.Module]:
    """The replica of each of `devices`: a frozen eval-mode copy of `model` per distinct device, shared by the workers
    on that device (they run it concurrently, as torch allows for inference without gradients). On the CPU the
    workers then read one set of weights, not one each: less memory, and the copies no longer compete for the
    caches (measured in bench/RESULTS.md). With an `example` (a batch), each copy is run at every batch size in
    `sizes` first, so that a model that fails, and the first slow forwards, happen here."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    copies: dict[torch.device, torch.nn.Module] = {}
    for device in devices:
        if device not in copies:
            replica = copies[device] = copy.deepcopy(model).to(device).eval()
            replica.requires_grad_(False)
    if example is not None:
        one = example[:1]
        for size in sizes:
            batch = one.expand(size, *one.shape[1:]).contiguous()
            for device, replica in copies.items():
                forward(replica, batch.to(device), size)
    return [copies[device] for device in devices]


def save_weights(replica: torch.nn.Module, path: Path) -> None:
    """`replica`'s parameters and buffers in `path` (written whole, then renamed into place), for `map_weights`."""
    partial = path.with_name(path.name + ".partial")
    torch.save(replica.state_dict(), partial)
    os.replace(partial, path)


def map_weights(replicas: Sequence[torch.nn.Module], path: Path) -> None:
    """Make the CPU replicas' parameters and buffers the tensors saved in `path`, mapped from the file: processes
    that map one file read one copy of the weights in memory (a copy each would compete for the caches and take N
    times the memory). `path` must hold the state of the same architecture (save_weights of a replica of it)."""
    state = torch.load(path, mmap=True, weights_only=True)
    for replica in {id(replica): replica for replica in replicas}.values():
        if on_cpu(replica):
            replica.load_state_dict(state, assign=True)


def on_cpu(replica: torch.nn.Module) -> bool:
    return all(tensor.device.type == "cpu" for tensor in replica.state_dict().values())


def forward(replica: torch.nn.Module, x: torch.Tensor, rows: int) -> torch.Tensor:
    with torch.no_grad():
        out = replica(x)
    check_output(out, rows)
    return out


def check_output(out: Any, rows: int) -> None:
    """What ParallelInference serves: a model returning one tensor with a row per example (`rows` of them).
    Raises ModelError saying what the model returned instead."""
    if not isinstance(out, torch.Tensor):
        raise ModelError(f"the model returned a {type(out).__name__}; ParallelInference serves models that return "
                         "one tensor")
    if out.dim() == 0 or out.shape[0] != rows:
        raise ModelError(f"the model returned shape {tuple(out.shape)} for a batch of {rows}; the output needs one "
                         "row per example")


def run_batch(replica: torch.nn.Module, device: torch.device, batch: list[Ticket], stats: InferenceStats,
              rows: int) -> int | None:
    """One forward for `batch` (`rows` examples in all) on `replica`, each request answered with its rows of the
    output; a failing batch of several requests is retried one request at a time so that only the request that breaks
    the model fails. The forward's time in ns (joining and splitting included), or None where it failed."""
    start = time.perf_counter_ns()
    try:
        x, as_numpy = join_inputs(batch)
        if device.type != "cpu":
            x = x.to(device, non_blocking=True)
        infer = time.perf_counter_ns()
        out = forward(replica, x, rows)
        output = time.perf_counter_ns()
        if out.device.type != "cpu":
            out = out.cpu()
        if as_numpy and out.dtype != torch.bfloat16:  # numpy has no bfloat16: those stay tensors
            out = out.numpy()
        pieces = split_output(out, batch)
    except Exception as error:
        requests = [one for item in batch for one in item.split()]  # a feed's bundle holds several
        if len(requests) > 1:
            for request in requests:
                run_batch(replica, device, [request], stats, request.rows)
            return None
        end = time.perf_counter_ns()
        stats.batch(batch, rows, start, end, end, end, (False,))
        batch[0].finish(None, error if isinstance(error, ModelError) else _model_error(error))
        return None
    end = time.perf_counter_ns()
    stats.batch(batch, rows, start, infer, output, end, (True,) * len(batch))
    for request, piece in zip(batch, pieces, strict=True):
        request.finish(piece, None)
    return end - start


def _model_error(error: Exception) -> ModelError:
    wrapped = ModelError(f"the model's forward failed: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped
