"""Who trains together in an elastic job (spec.elastic, recovery regroup), generation after generation: each rank's
side (the coordinator, coordinator.py, hosts the job's TCP store and plans the generations).

Every rank has a slot, its number in the job (RANK: on a cluster its pod's index). A generation is a process group
over some slots, built on the store under its own prefix (`g<n>/`), so that several generations of the group follow
one another in the same processes; its rank 0 (the lowest slot among its members) reports the status and writes the
checkpoints. When a member is lost (its connection closes: the collective raises; or its heartbeat stalls past
STALL_SECONDS: the wait in flight is abandoned), each survivor leaves the broken group and registers for the next
generation with the step it stands at, and waits for the coordinator's plan: the members, and the source whose state
every member takes (the survivor furthest on). A replacement process for a lost slot (started by the launcher or the
operator), slot 0's too, asks to join; rank 0 sees it waiting, and the ranks regroup at an agreed step boundary to
take it in. A scale-down's leavers go the same way.

What a rank cannot survive is the coordinator's loss (the store goes with it): the job falls back to a whole-group
restart from its latest checkpoint, as it does when the coordinator finds no generation can form
(`RegroupFailed`).

This module knows nothing of models: it hands out generations, and waits on collectives with an eye on the
members' heartbeats.
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.contract import GroupMustRestart

BEAT_SECONDS = 0.2
"""How often each member bumps its heartbeat counter in the store."""
STALL_SECONDS = 1.5
"""A member whose counter has not moved for this long is lost (a stopped process, a lost node: its connections stay
open, and a collective would wait for it until the group's timeout)."""
SETTLE_SECONDS = 0.5
"""The coordinator plans a generation once every old member has registered, or this long after the last one did:
the lost never register, and a survivor notices the loss within STALL_SECONDS at worst."""
JOIN_POLL_SECONDS = 0.05
GROUP_FAILURE_MARKS = ("gloo/", "NCCL", "Connection closed", "Connection reset", "Broken pipe")
"""What the message of a collective that failed because a peer went says (gloo and NCCL raise RuntimeError)."""


class GroupLost(Exception):
    """The generation this rank trains in lost a member: the step in flight is abandoned, the survivors regroup."""


class LeftGroup(Exception):
    """This rank asked to leave (`ask_to_leave`: its pod is going, the job scaled down) and the group went on
    without it: it is done."""


class JobFinished(Exception):
    """A process waiting to join found the job's training over: it has nothing to do."""


class RegroupFailed(GroupMustRestart):
    """No generation could be formed (too few ranks within the deadline, the coordinator lost, the same step lost
    again and again): the job falls back to a whole-group restart from its latest checkpoint."""


def is_group_failure(error: BaseException) -> bool:
    """Whether `error` is the group's (a peer lost), not this rank's own."""
    if isinstance(error, GroupLost | dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(mark in str(error) for mark in GROUP_FAILURE_MARKS)


@dataclass(frozen=True)
class Plan:
    """A generation: its members (slots, in rank order), the member whose state every other takes, and what
    changed from the generation before."""

    generation: int
    members: list[int]
    source: int
    """The slot furthest on (the highest step; the lowest slot among equals)."""
    steps: dict[int, int] = field(default_factory=dict)
    """Each member's step when it registered (a joiner: -1)."""
    lost: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    """Members that asked to leave (a scale-down)."""
    added: dict[int, int] = field(default_factory=dict)
    """The slots that join, each with the incarnation of the process that asked (a stale plan never takes in a
    slot's later process)."""
    fallback: str = ""
    """Why no generation could form: the job restarts whole."""

    @property
    def step(self) -> int:
        return self.steps.get(self.source, 0)

    def receives_state(self, slot: int) -> bool:
        """Whether `slot` takes the source's state: a joiner, or a survivor behind it."""
        return self.steps.get(slot, -1) != self.step

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "steps": {str(k): v for k, v in self.steps.items()},
                           "added": {str(k): v for k, v in self.added.items()}})

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        data = json.loads(text)
        return cls(**{**data, "steps": {int(k): v for k, v in data["steps"].items()},
                      "added": {int(k): v for k, v in data["added"].items()}})


def plan_generation(generation: int, previous: list[int], registered: dict[int, int], joiners: dict[int, int], *,
                    min_workers: int, max_workers: int, leaving: frozenset[int] = frozenset()) -> Plan:
    """The next generation from the old members, those of them that registered (slot -> step), those asking to
    leave, and the slots asking to join (slot -> incarnation); a fallback when fewer than `min_workers` are there."""
    left = sorted(set(registered) & leaving)
    survivors = sorted(set(registered) - leaving)
    room = max(0, max_workers - len(survivors))
    added = {slot: joiners[slot] for slot in sorted(set(joiners) - set(survivors) - leaving)[:room]}
    members = sorted(survivors + list(added))
    lost = sorted(set(previous) - set(registered))
    steps = {**{slot: registered[slot] for slot in survivors}, **{slot: -1 for slot in added}}
    if not survivors or len(members) < min_workers:
        return Plan(generation, members, -1, steps, lost, left, added,
                    fallback=f"{len(members)} rank(s) left, fewer than elastic.minWorkers ({min_workers})")
    source = min(survivors, key=lambda slot: (-registered[slot], slot))
    return Plan(generation, members, source, steps, lost, left, added)


class Beats:
    """The heartbeat counters seen of some slots (`beat/<slot>` in the store), and how long each has stood still."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, float]] = {}

    def still_for(self, slot: int, count: int, now: float) -> float:
        """Seconds since `slot`'s counter last moved, now that it reads `count` (0 when it moved)."""
        previous = self._seen.get(slot)
        if previous is None or previous[0] != count:
            self._seen[slot] = (count, now)
        return now - self._seen[slot][1]

    def keep(self, slots: list[int]) -> None:
        """Forget the slots not in `slots`."""
        self._seen = {slot: value for slot, value in self._seen.items() if slot in slots}


@contextlib.contextmanager
def coordinator_needed() -> Iterator[None]:
    """Talking to the store alone: an error is the coordinator's loss (RegroupFailed: the group restarts whole)."""
    try:
        yield
    except dist.DistError as error:
        raise RegroupFailed(f"the job's coordinator (its store) is gone: {error}") from error


class Membership:
    """One rank's side: its slot, the store, the current generation and its process group, the heartbeats."""

    def __init__(self, *, slot: int, addr: str, port: int, backend: str, deadline_seconds: float,
                 timeout: timedelta = timedelta(seconds=300)):
        self.slot = slot
        self.backend, self.deadline_seconds, self.timeout = backend, deadline_seconds, timeout
        self.store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
        self._beat_store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=5))
        self.incarnation = int(self.store.add(f"incarnation/{slot}", 1))
        """1 for a slot's first process; a replacement's is higher, and it joins instead of starting."""
        self.plan: Plan | None = None
        self.lost_peer: int | None = None
        """A member whose heartbeat stalled in this generation (set by the heartbeat thread)."""
        self.left_behind: int | None = None
        """The generation this rank was found left out of (the store names a later one: this rank stalled, and the
        others went on; its own connections to them may stay open)."""
        self.coordinator_lost = False
        self._watched: list[int] = []
        self._abandoned: list[dist.ProcessGroup] = []
        """The process groups of the generations left behind."""
        self._stop = threading.Event()
        threading.Thread(target=self._heartbeat, name="tandem-heartbeat", daemon=True).start()

    @property
    def rank(self) -> int:
        return self.plan.members.index(self.slot)

    @property
    def world_size(self) -> int:
        return len(self.plan.members)

    @property
    def joining(self) -> bool:
        """Whether this process replaces a lost one (or a member left out of a generation): it joins a running job."""
        return self.incarnation > 1

    def start(self) -> Plan:
        """Generation 1 (the slots the job started with) for their first processes; for a replacement, or a slot
        added later (a scale-up), the generation that takes it in."""
        first = Plan.from_json(self.store.get("plan/1"))  # waits for the coordinator to write it
        if self.joining or self.slot not in first.members or int(self.store.get("generation")) > 1:
            return self.join()
        return self._form(first)

    def join(self) -> Plan:
        """Ask to join, and wait for the generation that takes this slot in."""
        with coordinator_needed():
            self.store.delete_key(f"leave/{self.slot}")  # a slot that left before and is asked back
            index = int(self.store.add("joins", 1))
            self.store.set(f"join/{index}", json.dumps({"slot": self.slot, "incarnation": self.incarnation}))
            while True:
                if self.store.check(["generation"]):
                    generation = int(self.store.get("generation"))
                    plan = Plan.from_json(self.store.get(f"plan/{generation}"))
                    if plan.added.get(self.slot) == self.incarnation and not plan.fallback:
                        break
                if self.store.check(["finished"]):
                    raise JobFinished()
                time.sleep(JOIN_POLL_SECONDS)
        return self._form(plan)

    def regroup_wanted(self) -> bool:
        """Rank 0: whether a rank asks to join or to leave (the group should regroup at the next agreed step)."""
        if self.rank != 0:
            return False
        if int(self.store.add("joins", 0)) > int(self.store.get("joins/planned")):
            return True
        return any(self.store.check([f"leave/{slot}"]) for slot in self.plan.members)

    def ask_to_leave(self) -> None:
        """This rank is going (its pod deleted: a scale-down): the group regroups without it at an agreed step."""
        if not self.store.check([f"leave/{self.slot}"]):
            self.store.set(f"leave/{self.slot}", "1")

    def regroup(self, step: int) -> Plan:
        """Leave the current generation (broken, or ending at an agreed step) and enter the next, at `step`."""
        self.leave()
        current = self.plan
        generation = current.generation + 1
        self.store.set(f"alive/{generation}/{self.slot}", str(step))
        plan = self._wait_for_plan(generation)
        if plan.fallback:
            with contextlib.suppress(RuntimeError, dist.DistError):  # the coordinator gone already (past its linger)
                self.store.set(f"read/{generation}/{self.slot}", "1")
            raise RegroupFailed(plan.fallback)
        if self.slot in plan.left:
            self.plan = plan
            raise LeftGroup(f"rank {current.members.index(self.slot)} left the group at step {step}")
        if self.slot not in plan.members:
            return self.join()
        return self._form(plan)

    def wait(self, work: dist.Work | torch.futures.Future) -> None:
        """Wait for a collective (or a future that follows one), abandoning it (GroupLost) once a member's
        heartbeat stalls."""
        completed = work.is_completed if isinstance(work, dist.Work) else work.done
        pause = 0.00005
        while not completed():
            self.check()
            time.sleep(pause)
            pause = min(pause * 2, 0.002)
        work.wait()

    def check(self) -> None:
        if self.coordinator_lost:
            raise RegroupFailed("the job's coordinator (its store) is gone")
        if self.lost_peer is not None:
            raise GroupLost(f"rank {self.lost_peer}'s heartbeat stalled for over {STALL_SECONDS:g}s")
        if self.plan is not None and self.left_behind == self.plan.generation:
            raise GroupLost(f"the others went on to a later generation than {self.plan.generation} without this rank")

    def leave(self) -> None:
        """Leave the current generation's group (aborting what is in flight in it)."""
        self._watched = []
        if not dist.is_initialized():
            return
        group = dist.distributed_c10d._get_default_group()
        if hasattr(group, "abort"):
            group.abort()
        # Kept, never freed: gloo's destructor joins its threads, which wait on a stopped peer until the group's
        # timeout (abort does not wake them); they end then, or when its connections close.
        self._abandoned.append(group)
        gc.collect()
        dist.destroy_process_group()

    def finish(self) -> None:
        """Training over (every member says so, after the last collective: whichever is left): a process still
        waiting to join exits (JobFinished), and the coordinator ends once the members close."""
        self.store.set("finished", "1")

    def close(self) -> None:
        """This process is done with the group (the coordinator waits for the members to close before it ends)."""
        self._stop.set()
        with contextlib.suppress(RuntimeError, dist.DistError):  # the coordinator gone already
            self.store.set(f"closed/{self.slot}", "1")

    def _form(self, plan: Plan) -> Plan:
        """Build `plan`'s process group."""
        if plan.members.count(self.slot) != 1:
            raise RegroupFailed(f"slot {self.slot} is not a member of generation {plan.generation}")
        self.plan = plan
        self.lost_peer = None
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"g{plan.generation}/", self.store),
                                rank=self.rank, world_size=self.world_size, timeout=self.timeout)
        self._watched = [slot for slot in plan.members if slot != self.slot]
        return plan

    def _wait_for_plan(self, generation: int) -> Plan:
        deadline = time.monotonic() + self.deadline_seconds + SETTLE_SECONDS + 5
        key = f"plan/{generation}"
        with coordinator_needed():
            while not self.store.check([key]):
                if time.monotonic() > deadline or self.coordinator_lost:
                    raise RegroupFailed(f"no plan for generation {generation} from the coordinator")
                time.sleep(JOIN_POLL_SECONDS / 5)
            return Plan.from_json(self.store.get(key))

    def _heartbeat(self) -> None:
        """Bump this slot's counter; watch the members', noting the first that stops moving."""
        beats = Beats()
        while not self._stop.wait(BEAT_SECONDS):
            try:
                self._beat_store.add(f"beat/{self.slot}", 1)
                plan = self.plan
                if plan is not None and int(self._beat_store.get("generation")) > plan.generation:
                    self.left_behind = plan.generation
                now = time.monotonic()
                for slot in list(self._watched):
                    count = int(self._beat_store.add(f"beat/{slot}", 0))
                    if beats.still_for(slot, count, now) > STALL_SECONDS and self.lost_peer is None \
                            and slot in self._watched:
                        self.lost_peer = slot
                beats.keep(self._watched)
            except (RuntimeError, dist.DistError):
                self.coordinator_lost = True
