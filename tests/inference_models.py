"""Models for the inference tests, referenced as `inference_models:...` (tests/ is on sys.path under pytest, and
on PYTHONPATH for `tandem serve` subprocesses).

Tests hold requests at a known point with a Gate instead of sleeping: a gated model's forward waits while its
gate is closed, and records every batch size it ran (a Recorder also records which requests shared each forward,
with their shape and dtype). Replicas are deep copies, so the gate is shared state that deepcopy leaves alone.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from tandem.examples.digits import mlp

GATES: dict[str, Gate] = {}
POISON = 666.0
WAIT_LIMIT_S = 120.0  # a forward never waits longer than this, so a broken test cannot hang the suite


class Gate:
    """Shared by every replica of a model: open (forwards run) or closed (forwards wait)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.lock = threading.Lock()
        self.batches: list[int] = []
        self.forwards: list[Forward] = []
        self.threads: list[str] = []
        self.entered = 0

    def __deepcopy__(self, memo: dict) -> Gate:
        return self

    def close(self) -> None:
        self.open.clear()
        with self.lock:
            self.entered = 0
            self.batches.clear()
            self.forwards.clear()

    def wait_entered(self, count: int, timeout: float = 60.0) -> None:
        """Until `count` forwards have started (and are waiting at the closed gate)."""
        deadline = time.monotonic() + timeout
        while self.entered < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.entered} of {count} forwards started")
            time.sleep(0.005)


def seeded_mlp(seed: int = 0, hidden: int = 16) -> nn.Module:
    """The digits MLP with weights fixed by `seed`, without touching the global RNG."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return mlp(hidden=hidden).eval()


class Gated(nn.Module):
    def __init__(self, inner: nn.Module, gate: Gate):
        super().__init__()
        self.inner = inner
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate
        with gate.lock:
            gate.entered += 1
            gate.batches.append(x.shape[0])
            gate.threads.append(threading.current_thread().name)
        if not gate.open.wait(WAIT_LIMIT_S):
            raise RuntimeError("test gate never opened")
        if (x == POISON).any():
            raise ValueError(f"poisoned input ({POISON})")
        return self.inner(x)


def gated_mlp(name: str, seed: int = 0, hidden: int = 16) -> nn.Module:
    """seeded_mlp behind the gate GATES[name] (created on first use); raises on inputs holding POISON."""
    gate = GATES.setdefault(name, Gate())
    return Gated(seeded_mlp(seed, hidden), gate)


def slow_to_build(name: str, seed: int = 0) -> nn.Module:
    """Building this model waits for GATES[name] to open: the server stays unready meanwhile."""
    gate = GATES.setdefault(name, Gate())
    if not gate.open.wait(WAIT_LIMIT_S):
        raise RuntimeError("test gate never opened")
    return seeded_mlp(seed)


def unbuildable_once(flag: str, seed: int = 0) -> nn.Module:
    """seeded_mlp, until the file `flag` exists: then building it raises (a load that fails in one process)."""
    if Path(flag).exists():
        raise RuntimeError(f"{flag} exists: this model will not be built")
    return seeded_mlp(seed)


class FileGated(nn.Module):
    """For a server in another process: forwards after the first wait until the file `gate` exists."""

    def __init__(self, inner: nn.Module, gate: str):
        super().__init__()
        self.inner = inner
        self.gate = gate
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        deadline = time.monotonic() + WAIT_LIMIT_S
        while x.shape[0] == 1 and (x == 1.0).all() and not Path(self.gate).exists():
            if time.monotonic() > deadline:
                raise RuntimeError("test gate file never appeared")
            time.sleep(0.01)
        return self.inner(x)


def file_gated_mlp(gate: str, seed: int = 0) -> nn.Module:
    """Inputs of all ones wait for the file `gate` (warm-up uses zeros and passes)."""
    return FileGated(seeded_mlp(seed), gate)


class Forward(NamedTuple):
    """One forward a Recorder ran: the request id of each row, the per-example shape, the dtype."""

    ids: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


class Recorder(nn.Module):
    """Gated like Gated, for batching by shape and dtype: every value of a request's input is its request id.
    Each forward is recorded as a Forward (the row ids tell which requests shared it), and each row is answered
    with its id, in the input's dtype (so a request merged into a batch of another dtype comes back in that
    dtype). Accepts any per-example shape and dtype."""

    def __init__(self, gate: Gate):
        super().__init__()
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(x.shape[0], -1)
        gate = self.gate
        with gate.lock:
            gate.entered += 1
            gate.batches.append(x.shape[0])
            gate.forwards.append(Forward(tuple(int(i) for i in rows[:, 0].tolist()), tuple(x.shape[1:]), x.dtype))
        if not gate.open.wait(WAIT_LIMIT_S):
            raise RuntimeError("test gate never opened")
        return rows[:, :1].clone()


def recorder(name: str) -> nn.Module:
    """A Recorder behind the gate GATES[name] (created on first use)."""
    return Recorder(GATES.setdefault(name, Gate()))


class AtMost(nn.Module):
    """seeded_mlp that raises on batches of more than `rows` examples (a model with a fixed-size buffer, say)."""

    def __init__(self, rows: int, seed: int = 0):
        super().__init__()
        self.rows = rows
        self.inner = seeded_mlp(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.rows:
            raise RuntimeError(f"this model takes at most {self.rows} examples, not {x.shape[0]}")
        return self.inner(x)


def at_most(rows: int, seed: int = 0) -> nn.Module:
    return AtMost(rows, seed)
