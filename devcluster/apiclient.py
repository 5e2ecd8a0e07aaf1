"""The small API client of the test kubelet and the Deployment controller (aiohttp, on the emulator's event loop):
JSON requests, watch streams, and `Informer` (a list-then-watch cache of one resource, as client-go's)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{status}: {message}")
        self.status, self.body = status, body


class Api:
    def __init__(self, url: str, token: str | None = None) -> None:
        """`token`: the bearer token the emulator knows this client by (faults.py: `client-kubelet` is `kubelet`)."""
        self.url, self.token = url, token
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        self._session = aiohttp.ClientSession(self.url, read_bufsize=2 ** 22, headers=headers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                      params: Mapping[str, str] | None = None) -> Any:
        data = None if body is None else json.dumps(body)
        async with self._session.request(method, path, data=data, params=params,
                                         headers={"Content-Type": content_type}) as response:
            text = await response.text()
            try:
                payload = json.loads(text) if text else None
            except ValueError:
                payload = text
            if response.status >= 400:
                raise ApiError(response.status, payload)
            return payload

    async def get(self, path: str) -> Any:
        """The object at `path`, or None when it does not exist."""
        try:
            return await self.request("GET", path)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def patch_status(self, path: str, status: dict[str, Any]) -> Any:
        return await self.request("PATCH", f"{path}/status", {"status": status}, MERGE_PATCH)

    async def watch(self, path: str, resource_version: str) -> AsyncIterator[dict[str, Any]]:
        params = {"watch": "true", "resourceVersion": resource_version}
        async with self._session.get(path, params=params, timeout=aiohttp.ClientTimeout(total=None)) as response:
            if response.status >= 400:
                raise ApiError(response.status, await response.text())
            async for line in response.content:
                if line.strip():
                    yield json.loads(line)


def _version(obj: Mapping[str, Any]) -> int:
    try:
        return int(obj["metadata"].get("resourceVersion") or 0)
    except ValueError:  # opaque on a real API server; the emulator's are one counter
        return 0


class Informer:
    """One resource's objects as the API tells them: a list, then a watch from the list's resourceVersion; a watch
    that fails lists again, and a watch that is Gone (410) lists again and reports an object missing from the new list
    as DELETED. `on_event(type, obj)` hears every object listed (ADDED) and every later change; `objects` holds the
    latest version of each live object by uid. A version older than the one held is dropped, so a client may
    `remember` what its own write answered before the watch brings it."""

    def __init__(self, api: Api, path: str, on_event: Callable[[str, dict[str, Any]], None]) -> None:
        self.api, self.path, self.on_event = api, path, on_event
        self.objects: dict[str, dict[str, Any]] = {}
        self._gone: set[str] = set()  # uids removed: a late event of theirs must not bring them back
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        version = await self._list()
        self._task = asyncio.create_task(self._watch(version), name=f"watch {self.path}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def remember(self, obj: dict[str, Any], deleted: bool = False) -> None:
        """Hold a version this client wrote (or deleted), without telling `on_event`."""
        self._hold("DELETED" if deleted else "MODIFIED", obj)

    def _hold(self, type_: str, obj: dict[str, Any]) -> bool:
        uid = obj["metadata"]["uid"]
        if type_ == "DELETED":
            self._gone.add(uid)
            self.objects.pop(uid, None)
            return True
        held = self.objects.get(uid)
        if uid in self._gone or (held is not None and _version(held) > _version(obj)):
            return False
        self.objects[uid] = obj
        return True

    def _tell(self, type_: str, obj: dict[str, Any]) -> None:
        if self._hold(type_, obj):
            self.on_event(type_, obj)

    async def _list(self) -> str:
        listing = await self.api.request("GET", self.path)
        seen = {obj["metadata"]["uid"] for obj in listing["items"]}
        for uid in set(self.objects) - seen:
            self._tell("DELETED", self.objects[uid])
        for obj in listing["items"]:
            self._tell("ADDED", obj)
        return listing["metadata"]["resourceVersion"]

    async def _watch(self, version: str) -> None:
        while True:
            try:
                async for event in self.api.watch(self.path, version):
                    if event["type"] == "ERROR":
                        version = await self._list()
                        break
                    self._tell(event["type"], event["object"])
                    version = event["object"]["metadata"]["resourceVersion"]
            except (aiohttp.ClientError, ApiError) as error:
                logger.warning("the watch of %s failed (%s); watching again", self.path, error)
                await asyncio.sleep(0.2)
