"""The server processes of one pod (an InferencePool's processesPerReplica, `tandem serve --processes N`): each is an
InferenceServer with its own event loop and model replicas, serving the connections to the pod's ports that the
supervisor hands it in turn (processes.py), so a client's connection lands on any of them. They keep one face to
clients and to the operator by talking over Unix sockets in the group's private directory (HTTP/1.1, JSON):

    GET  /peer/state           this process's counters (statistics, /metrics' request outcomes, pending requests)
                               and readiness: the process answering a statistics, /metrics or readiness request sums
                               them (for readiness: every process must be ready)
    PUT  /peer/group/batching  (to the leader) make this batching change in the group
    POST /peer/group/swap      (to the leader) swap the group to this checkpoint
    PUT  /peer/batching        (from the leader) run with these batching settings
    POST /peer/prepare         (from the leader) load and warm up this checkpoint, and hold it
    POST /peer/commit          (from the leader) switch to the checkpoint held
    POST /peer/abandon         (from the leader) drop it
    POST /peer/skipped         (from the leader) its gate skipped this candidate, for every process's metadata
    POST /peer/refused         (from the leader) the group refused the pool's batching settings (pool_watch.py), for
                               every process's readiness answer

Process 0, the leader, makes every change for the group, one at a time: a process asked for a batching change or a
load hands it to the leader, and only the leader follows a training job's checkpoints. A batching change is made in
every process or (one refusing, the others changing back) in none. A swap is prepared everywhere first, then every
process switches at once (within a request's round trip of each other), or none does when one fails to prepare.

On CPU the processes serve one copy of the weights (SharedWeights): the leader saves its model's weights in the
group's directory and every process maps that file in place of its own copy, so that the processes neither compete
for the caches with copies of the same weights nor take N times the memory, and a model built with random weights
answers alike in every process. The leader's first model is every process's first model (`first.json`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from tandem.api.inference import BatchingSettings
from tandem.worker.serve.http import HttpServer, Request
from tandem.worker.serve.model_loading import ModelLoadError
from tandem.worker.serve.processes import Group
from tandem.worker.serve.promotion import Verdict
from tandem.worker.serve.protocol import dumps
from tandem.worker.serve.replicas import map_weights, on_cpu, save_weights
from tandem.worker.serve.served_model import BatchingRefused

if TYPE_CHECKING:
    from tandem.worker.serve.app import InferenceServer

log = logging.getLogger("tandem.serve")

STATE_TIMEOUT_SECONDS = 5.0
"""A peer that does not say its state within this is counted not ready (and a statistics request fails)."""
MAX_PEER_BODY = 1 << 20


class PeerError(ModelLoadError):
    """Another server process of the pod refused a change or did not answer."""


class Peer:
    """Another server process of the pod, as a client sees it."""

    def __init__(self, group: Group, index: int):
        self.index = index
        self.label = f"server process {index + 1} of {group.size}"
        self._path = str(group.socket_path(index))
        self._session: aiohttp.ClientSession | None = None

    async def state(self) -> dict[str, Any]:
        state = await self._call("GET", "/peer/state", None, STATE_TIMEOUT_SECONDS)
        if state["stats"] is not None:
            state["stats"]["batches"] = {int(size): values for size, values in state["stats"]["batches"].items()}
        return state

    async def update_batching(self, settings: BatchingSettings) -> None:
        await self._call("PUT", "/peer/batching", settings.to_dict())

    async def group_batching(self, settings: BatchingSettings) -> None:
        await self._call("PUT", "/peer/group/batching", settings.to_dict(), label=False)

    async def group_swap(self, checkpoint: Path | None, cause: str) -> None:
        await self._call("POST", "/peer/group/swap", {"checkpoint": _path(checkpoint), "cause": cause}, label=False)

    async def prepare_swap(self, checkpoint: Path | None, weights: Path | None) -> None:
        await self._call("POST", "/peer/prepare", {"checkpoint": _path(checkpoint), "weights": _path(weights)})

    async def commit_swap(self, cause: str) -> None:
        await self._call("POST", "/peer/commit", {"cause": cause})

    async def abandon_swap(self) -> None:
        await self._call("POST", "/peer/abandon", {})

    async def record_skip(self, checkpoint: str, verdict: Verdict) -> None:
        await self._call("POST", "/peer/skipped", {"checkpoint": checkpoint, **dataclasses.asdict(verdict)})

    async def record_refusal(self, settings: BatchingSettings, reason: str) -> None:
        await self._call("POST", "/peer/refused", {"settings": settings.to_dict(), "reason": reason})

    async def _call(self, method: str, path: str, body: Any, timeout: float | None = None, label: bool = True) -> Any:
        """The peer's JSON answer. Raises BatchingRefused for a refused batching change (400), PeerError for any
        other refusal (its message after this peer's name, unless not `label`: the leader's answers name the process
        that refused) or no answer."""
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self._path))
        try:
            async with self._session.request(method, f"http://peer{path}", data=None if body is None else dumps(body),
                                             timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                answer = orjson.loads(await response.read())
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as error:
            raise PeerError(f"{self.label} did not answer: {type(error).__name__}: {error}") from error
        if response.status != 200:
            message = f"{self.label}: {answer.get('error')}" if label else answer.get("error")
            raise BatchingRefused(message) if response.status == 400 and path.endswith("/batching") else \
                PeerError(message)
        return answer

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


class SharedWeights:
    """The weights file the group's processes map (replicas.map_weights), which the leader writes: one per model
    served, in the group's directory."""

    def __init__(self, group: Group):
        self.group = group
        self._first = group.directory / "first.json"
        self._written = 0

    async def publish(self, replicas: list) -> Path | None:
        """(The leader) `replicas`' weights saved in a new file and mapped from it; None where they are not on the
        CPU (each GPU keeps its own copy)."""
        if not on_cpu(replicas[0]):
            return None
        self._written += 1
        path = self.group.directory / f"weights-{self._written}.pt"
        await asyncio.to_thread(save_weights, replicas[0], path)
        await asyncio.to_thread(map_weights, replicas, path)
        return path

    async def publish_first(self, checkpoint: str | None, replicas: list) -> Path | None:
        """(The leader) `publish`, then tell the others which checkpoint it loaded first (`leaders_first`)."""
        path = await self.publish(replicas)
        partial = self._first.with_name("first.partial")
        partial.write_text(json.dumps({"checkpoint": checkpoint, "weights": _path(path)}))
        os.replace(partial, self._first)
        return path

    async def leaders_first(self) -> tuple[Path | None, Path | None]:
        """The checkpoint the leader loaded first (None: its model's source, a callable) and its weights file, once it
        has (while it waits for a training job's first checkpoint, so do the others)."""
        while not self._first.exists():
            await asyncio.sleep(0.05)
        first = json.loads(self._first.read_text())
        return _optional_path(first["checkpoint"]), _optional_path(first["weights"])

    @staticmethod
    async def map(replicas: list, path: Path | None) -> None:
        if path is not None:
            await asyncio.to_thread(map_weights, replicas, path)

    def discard(self, path: Path | None) -> None:
        """(The leader) a weights file no longer served (the processes that mapped it keep their mapping)."""
        if path is not None and self.group.leader:
            path.unlink(missing_ok=True)


class Peers:
    """The other server processes of the pod, each asked at once."""

    def __init__(self, group: Group):
        self.group = group
        self.others = [Peer(group, index) for index in range(group.size) if index != group.index]
        self.lock = asyncio.Lock()
        """Held by the leader while it makes a change for the group."""
        self.weights = SharedWeights(group)

    @property
    def leader(self) -> Peer:
        return self.others[0]

    async def states(self) -> list[dict[str, Any] | PeerError]:
        """Each peer's state, or the error of one that did not answer."""
        return await asyncio.gather(*(peer.state() for peer in self.others), return_exceptions=True)

    async def close(self) -> None:
        await asyncio.gather(*(peer.close() for peer in self.others))


class PeerRoutes:
    """What a server process answers its peers, on its Unix socket."""

    def __init__(self, server: InferenceServer):
        self.server = server
        self.http = HttpServer(self.handle, lambda: MAX_PEER_BODY, on_error=_log_crash)
        self._changes = {
            ("PUT", "/peer/group/batching"): self._group_batching, ("POST", "/peer/group/swap"): self._group_swap,
            ("PUT", "/peer/batching"): self._update_batching, ("POST", "/peer/prepare"): self._prepare,
            ("POST", "/peer/commit"): self._commit, ("POST", "/peer/abandon"): self._abandon,
            ("POST", "/peer/skipped"): self._record_skip, ("POST", "/peer/refused"): self._record_refusal,
        }

    async def start(self, path: Path) -> None:
        await self.http.start_unix(str(path))

    async def close(self) -> None:
        await self.http.close()

    def handle(self, request: Request):
        if (request.method, request.path) == ("GET", "/peer/state"):
            request.respond(200, orjson.dumps(self.server.routes.local_state(), option=orjson.OPT_NON_STR_KEYS))
            return None
        handler = self._changes.get((request.method, request.path))
        if handler is None:
            request.respond(404, dumps({"error": f"no peer endpoint {request.method} {request.path}"}))
            return None
        return self._answer(request, handler)

    async def _answer(self, request: Request, handler) -> None:
        try:
            await handler(orjson.loads(request.body))
        except BatchingRefused as error:
            request.respond(400, dumps({"error": str(error)}))
        except ModelLoadError as error:
            request.respond(503, dumps({"error": str(error)}))
        else:
            request.respond(200, b"{}")

    async def _group_batching(self, body: dict[str, Any]) -> None:
        await self.server.update_batching(BatchingSettings.model_validate(body))

    async def _group_swap(self, body: dict[str, Any]) -> None:
        await self.server.model.swap(_optional_path(body["checkpoint"]), body["cause"])

    async def _update_batching(self, body: dict[str, Any]) -> None:
        await self.server.update_batching_here(BatchingSettings.model_validate(body))

    async def _prepare(self, body: dict[str, Any]) -> None:
        await self.server.model.prepare_swap(_optional_path(body["checkpoint"]), _optional_path(body["weights"]))

    async def _commit(self, body: dict[str, Any]) -> None:
        self.server.model.commit_swap(body["cause"])

    async def _abandon(self, body: dict[str, Any]) -> None:
        self.server.model.abandon_swap()

    async def _record_skip(self, body: dict[str, Any]) -> None:
        checkpoint = body.pop("checkpoint")
        self.server.model.record_skip(checkpoint, Verdict(**body))

    async def _record_refusal(self, body: dict[str, Any]) -> None:
        self.server.model.record_refusal(BatchingSettings.model_validate(body["settings"]), body["reason"])


def _path(checkpoint: Path | None) -> str | None:
    return None if checkpoint is None else str(checkpoint)


def _optional_path(value: str | None) -> Path | None:
    return None if value is None else Path(value)


def _log_crash(request: Request, error: BaseException) -> None:
    log.error("unexpected error answering a peer's %s %s", request.method, request.path, exc_info=error)
