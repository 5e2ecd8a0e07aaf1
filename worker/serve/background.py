"""An InferenceServer on its own event loop in a daemon thread: for embedding a server in a program, and for
tests (the `served` fixture)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.api.inference import BatchingSettings
from tandem.worker.serve.model_loading import LoadedModel

if TYPE_CHECKING:
    from tandem.worker.serve.app import InferenceServer


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (a dependency on Linux and macOS; measured in
    bench/RESULTS.md), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class BackgroundServer:
    """Starts `server` on a new event loop in a daemon thread and returns once its model is loaded (or raises
    the load error). `stop()` or leaving the `with` block stops it at once; `drain()` stops it gracefully."""

    def __init__(self, server: InferenceServer, host: str, port: int, ready_timeout: float,
                 grpc_port: int | None = None):
        self.server = server
        self.host = host
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-serve", daemon=True)
        self._thread.start()
        self.port = self._call(server.start(host, port, grpc_port), ready_timeout)
        self.grpc_port = server.grpc_port
        try:
            self._call(self._wait_loaded(), ready_timeout)
        except BaseException:
            self.stop()
            raise

    async def _wait_loaded(self) -> None:
        await self.server.loading

    def _call(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    @property
    def url(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def swap(self, checkpoint: str | Path | None = None, timeout: float = 120.0) -> LoadedModel:
        """Hot-swap to `checkpoint` (a file or a directory's latest; None: reload the current source)."""
        return self._call(self.server.model.swap(None if checkpoint is None else Path(checkpoint)), timeout)

    def update_batching(self, settings: BatchingSettings, timeout: float = 120.0) -> None:
        """Run with new batching settings (InferenceServer.update_batching: what a server started with --watch-pool
        does when its pool changes). Raises BatchingRefused when the model fails at them."""
        self._call(self.server.update_batching(settings), timeout)

    def drain(self, grace_seconds: float | None = None, timeout: float = 120.0) -> bool:
        result = self._call(self.server.drain(grace_seconds), timeout)
        self._close_loop()
        return result

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._call(self.server.stop(), 60)
        self._close_loop()

    def _close_loop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
