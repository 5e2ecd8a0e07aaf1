"""One pod on the test kubelet's node: its record (`PodRun`) and its container's main process (`Process`)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import podstatus

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Before exec, in the child: the kernel SIGKILLs it when the thread that started it ends (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Process:
    """A container's main process, its end awaited through a pidfd on the event loop: no waiter thread (asyncio's
    subprocesses take one per child, which can outlive a shutdown)."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen, self.pid = popen, popen.pid
        self._loop = asyncio.get_running_loop()
        self._ended: asyncio.Future[int] = self._loop.create_future()
        self._fd = os.pidfd_open(popen.pid)
        self._loop.add_reader(self._fd, self._reap)

    def _reap(self) -> None:
        self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._ended.set_result(self.popen.wait())

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)


@dataclass
class PodRun:
    uid: str
    pod: dict[str, Any]
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    removed: bool = False
    process: Process | None = None
    logs: list[Path] = field(default_factory=list)
    book: podstatus.StatusBook | None = None
    task: asyncio.Task | None = None
    started: bool = False  # the running container's startup probe succeeded (or it has none)
    ready: bool = False  # ... and its readiness probe says ready (or it has none)
    stop: Any = None  # a probe's `Kill`: the container must go, though the pod stays
    last_report: dict[str, Any] | None = None  # the arguments of the last status written
    reported: tuple[bool, bool] = (False, False)  # (started, ready) as last written

    @property
    def deleting(self) -> bool:
        return self.removed or bool(self.pod["metadata"].get("deletionTimestamp"))

    @property
    def grace(self) -> float:
        if self.removed:
            return 0
        meta, spec = self.pod["metadata"], self.pod.get("spec", {})
        grace = meta.get("deletionGracePeriodSeconds")
        return float(grace if grace is not None else spec.get("terminationGracePeriodSeconds", 30))

    @property
    def path(self) -> str:
        meta = self.pod["metadata"]
        return f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"


class quietly:
    """Ignore a process that is already gone (or a timeout), as `contextlib.suppress` but for these only."""

    def __init__(self, *errors: type[BaseException]) -> None:
        self.errors = errors or (ProcessLookupError, PermissionError)

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, traceback) -> bool:
        return kind is not None and issubclass(kind, self.errors)
