"""Gangs of pods (a training job's ranks), replayed from the API server's own record of pod events (`Store.log`),
for checks that must hold over a whole run rather than at its end: the chaos suite and bench/bench_chaos.py.

A gang's pods carry three labels: their owner (the job), their group and their rank. A group, as replayed here, is
an owner's pods from one created while none of the owner's was alive, until the last of them is gone: so a group
started again with the same group label (a suspended job resumed) still counts as a new one."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .store import Event


@dataclass
class Gangs:
    groups: dict[str, int] = field(default_factory=dict)
    """How many groups each owner started."""
    created: dict[tuple[str, int, str | None], list[str]] = field(default_factory=dict)
    """(owner, group number, rank) -> the uids of the pods created for it."""
    ran: dict[tuple[str, int], set[str | None]] = field(default_factory=dict)
    """(owner, group number) -> the ranks whose pod was Running, Succeeded or Failed at some point."""
    overlaps: list[str] = field(default_factory=list)
    """Pods created while a pod of another group of their owner, or one being deleted, was alive."""
    events: int = 0

    @property
    def duplicates(self) -> dict[tuple[str, int, str | None], list[str]]:
        """Ranks of a group for which more than one pod was created."""
        return {key: uids for key, uids in self.created.items() if len(uids) > 1}


def replay(events: Iterable[Event], owner_label: str, group_label: str, rank_label: str) -> Gangs:
    gangs = Gangs()
    alive: dict[str, dict[str, tuple[str | None, bool]]] = {}  # owner -> {pod: (group label, being deleted)}
    for event in events:
        gangs.events += 1
        metadata = event.obj["metadata"]
        labels = metadata.get("labels") or {}
        owner = labels.get(owner_label)
        if owner is None:
            continue
        pods = alive.setdefault(owner, {})
        if event.type == "DELETED":
            pods.pop(metadata["name"], None)
            continue
        group, rank = labels.get(group_label), labels.get(rank_label)
        if event.type == "ADDED":
            if any(deleting or other != group for other, deleting in pods.values()):
                gangs.overlaps.append(f"{metadata['name']} (group {group}) created while {pods} were alive")
            if not pods:
                gangs.groups[owner] = gangs.groups.get(owner, 0) + 1
            gangs.created.setdefault((owner, gangs.groups[owner], rank), []).append(metadata["uid"])
        if (event.obj.get("status") or {}).get("phase") in ("Running", "Succeeded", "Failed"):
            gangs.ran.setdefault((owner, gangs.groups.get(owner, 0)), set()).add(rank)
        pods[metadata["name"]] = (group, bool(metadata.get("deletionTimestamp")))
    return gangs
