"""The emulator's memory: objects with their history, one resourceVersion counter, an event log per resource.

Objects live in kmock's `ObjectsArray` (so `emulator.objects[...]` keeps working, with every version of every object
in `.history`). Every change goes through `commit()`: it takes the next resourceVersion of the whole store, appends a
watch event to the resource's log and hands it to the live watches. A watch subscribes under the same lock as
commits, so a list followed by a watch from the list's resourceVersion sees every later event exactly once.

Thread safety: commits happen on the emulator's event loop; the read methods (`get`, `items`, `history`) may be
called from any thread (test code) and return deep copies.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kmock

Key = tuple[kmock.resource, str | None, str]  # resource, namespace (None: cluster-scoped), name
LOG_LIMIT = 20_000  # events kept per resource; a watch from an older resourceVersion gets 410 Gone


@dataclass(frozen=True)
class Event:
    revision: int
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None  # the previous state: a selector-filtered watch turns MODIFIED into ADDED/DELETED


class Gone(Exception):
    """The events after the requested resourceVersion are no longer kept: the watcher must list again."""


class Store:
    def __init__(self, objects: kmock.ObjectsArray) -> None:
        self.objects = objects
        self.mutex = threading.RLock()
        self.revision = 0
        self._logs: dict[kmock.resource, deque[Event]] = defaultdict(lambda: deque(maxlen=LOG_LIMIT))
        self._forgotten: dict[kmock.resource, int] = defaultdict(int)  # the newest revision dropped from a log
        self._watchers: dict[kmock.resource, set[asyncio.Queue[Event | None]]] = defaultdict(set)
        self._uids: dict[str, Key] = {}
        self._live: dict[kmock.resource, dict[Key, None]] = defaultdict(dict)  # live keys by resource, in order
        self._closed = False

    # -- reads (any thread) ---------------------------------------------------------------------------------------
    def live(self, key: Key) -> dict[str, Any] | None:
        """The stored object itself (not a copy: never mutate it), or None."""
        with self.mutex:
            if key not in self.objects:
                return None
            obj = self.objects[key]
            return None if obj.deleted else obj.raw

    def get(self, key: Key) -> dict[str, Any] | None:
        with self.mutex:
            return copy.deepcopy(self.live(key))

    def keys(self, resource: kmock.resource, namespace: str | None = None) -> list[Key]:
        with self.mutex:
            return [key for key in self._live[resource] if namespace is None or key[1] == namespace]

    def items(self, resource: kmock.resource, namespace: str | None = None) -> list[dict[str, Any]]:
        with self.mutex:
            return [copy.deepcopy(self.live(key)) for key in self.keys(resource, namespace)]

    def all_live(self) -> Iterator[tuple[Key, dict[str, Any]]]:
        with self.mutex:
            return iter([(key, self.live(key)) for keys in self._live.values() for key in keys])

    def history(self, key: Key) -> list[dict[str, Any] | None]:
        """Every version of the object, oldest first; None marks a deletion."""
        with self.mutex:
            if key not in self.objects:
                return []
            return [None if v is None else copy.deepcopy(v.raw) for v in self.objects[key].history]

    def log(self, resource: kmock.resource | str) -> list[Event]:
        """The events kept of a resource (the last LOG_LIMIT), oldest first: what a watch from the start would see.
        `resource` may be its plural alone ('pods')."""
        with self.mutex:
            logs = [log for key, log in self._logs.items() if key == resource or getattr(key, "plural", None) ==
                    resource]
            return sorted((event for log in logs for event in log), key=lambda event: event.revision)

    def uid_exists(self, uid: str) -> bool:
        with self.mutex:
            return uid in self._uids

    # -- writes (the event loop only) -----------------------------------------------------------------------------
    def commit(self, key: Key, type_: str, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        """Store `obj` (a fresh dict the store now owns) as the object's next version, stamped with the next
        resourceVersion of the whole store, and tell the watches."""
        with self.mutex:
            self.revision += 1
            obj["metadata"]["resourceVersion"] = str(self.revision)
            uid = obj["metadata"].get("uid")
            if type_ == "DELETED":
                self.objects[key].delete()
                self._uids.pop(uid, None)
                self._live[key[0]].pop(key, None)
            else:
                if key in self.objects:
                    self.objects[key].history.append(obj)
                else:
                    self.objects[key] = obj
                obj = self.objects[key].raw
                self._uids[uid] = key
                self._live[key[0]][key] = None
            event = Event(self.revision, type_, obj, old)
            log = self._logs[key[0]]
            if len(log) == log.maxlen:
                self._forgotten[key[0]] = log[0].revision
            log.append(event)
            for queue in self._watchers[key[0]]:
                queue.put_nowait(event)
            return obj

    def subscribe(self, resource: kmock.resource, since: int | None
                  ) -> tuple[list[dict[str, Any]], list[Event], asyncio.Queue[Event | None]]:
        """For a watch: the objects now (to send as ADDED when no resourceVersion was given), the events after
        `since`, and a queue of every later event; all taken at one instant."""
        with self.mutex:
            if since is not None and since < self._forgotten[resource]:
                raise Gone(f"too old resource version: {since} ({self._forgotten[resource]})")
            queue: asyncio.Queue[Event | None] = asyncio.Queue()
            if self._closed:
                queue.put_nowait(None)
            self._watchers[resource].add(queue)
            current = [] if since is not None else [self.live(key) for key in self.keys(resource)]
            backlog = [event for event in self._logs[resource] if since is not None and event.revision > since]
            return current, backlog, queue

    def watches(self, resource: kmock.resource) -> int:
        with self.mutex:
            return len(self._watchers[resource])

    def unsubscribe(self, resource: kmock.resource, queue: asyncio.Queue[Event | None]) -> None:
        with self.mutex:
            self._watchers[resource].discard(queue)

    def close(self) -> None:
        """End every watch (the emulator is stopping)."""
        with self.mutex:
            self._closed = True
            for queues in self._watchers.values():
                for queue in queues:
                    queue.put_nowait(None)
