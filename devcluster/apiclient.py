"""The kubelet's own small API client (aiohttp, on the emulator's event loop): JSON requests and watch streams."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{status}: {message}")
        self.status, self.body = status, body


class Api:
    def __init__(self, url: str) -> None:
        self.url = url
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(self.url, read_bufsize=2 ** 22)

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
