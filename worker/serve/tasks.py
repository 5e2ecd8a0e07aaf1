"""Stopping the asyncio tasks the server starts (the first load, the timeout sweep, following checkpoints)."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel `task` unless it is done, and wait until it has stopped (whatever it raised on the way out)."""
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
