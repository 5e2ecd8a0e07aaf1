"""`tandem worker coordinator`: an elastic job's store and planner, in a process of its own so that no rank's loss
takes them down (membership.py is the ranks' side).

It hosts the job's TCP store, writes generation 1 (every slot), and plans each later one: once a member registers
for the next generation (`alive/<g>/<slot>`: its group broke, or the ranks agreed on a step to let a joiner in or a
leaver out), it waits for the old members (all of them, or SETTLE_SECONDS past the last to register) and takes in
the slots asking to join, then writes the plan (`plan/<g>`, then `generation`). Which rank of a generation is rank
0 (who reports the status and writes the checkpoints) is the plan's business: the lowest slot among its members.

It falls back to a whole-group restart from the latest checkpoint (the plan names why; the ranks raise RegroupFailed
and this process exits 1, once the ranks waiting for the plan have read it) when a regroup cannot gather `minWorkers`
ranks within `regroupDeadlineSeconds`, when the group is lost REPEATS_BEFORE_RESTART times at the same step, or when
every member's heartbeat stalls. Once the ranks mark the training finished it waits for the last generation's
members to close, then exits 0: for `tandem run` and the operator, that is the job's success. SIGTERM (the job
suspended or deleted: the ranks checkpoint) keeps it serving until the members close, or STOP_GRACE_SECONDS.

`tandem run` starts it beside the ranks (worker/local_group.py); on a cluster the operator runs it in a pod of its
own, `<job>-coordinator`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from tandem.api import ParallelTrainingJob
from tandem.contract import MASTER_PORT, SPEC, WORLD_SIZE, ContractError
from tandem.worker.train.membership import (
    BEAT_SECONDS,
    JOIN_POLL_SECONDS,
    SETTLE_SECONDS,
    STALL_SECONDS,
    Beats,
    Plan,
    plan_generation,
)

REPEATS_BEFORE_RESTART = 3
"""Regroups in a row at the same step before the job falls back to a whole-group restart (a rank that fails the
same way wherever its examples go)."""
LINGER_SECONDS = 10.0
"""After the training finished: the longest the store waits for the members to close (a joiner still waiting
learns the job is over from it)."""
STOP_GRACE_SECONDS = 55.0
"""After SIGTERM: the longest the store waits for the members to close (within a pod's 60 s grace period)."""


def say(line: str) -> None:
    print(f"tandem coordinator: {line}", file=sys.stderr, flush=True)


class Coordinator:
    def __init__(self, *, workers: int, min_workers: int, max_workers: int, port: int, deadline_seconds: float,
                 timeout: timedelta = timedelta(seconds=300)):
        self.workers, self.min_workers, self.max_workers = workers, min_workers, max_workers
        self.deadline_seconds = deadline_seconds
        self.store = dist.TCPStore("localhost", port, is_master=True, wait_for_workers=False, timeout=timeout)
        self.store.set("joins", "0")
        self.stopping = threading.Event()
        self._joins_taken = 0
        self._regroups_at: list[int] = []
        self._beats = Beats()

    def run(self) -> int:
        plan = Plan(1, list(range(self.workers)), 0, dict.fromkeys(range(self.workers), 0))
        self._publish(plan)
        say(f"generation 1: slots {plan.members}")
        while True:
            if self.store.check(["finished"]):
                self._wait_for_members(plan.members, "closed", LINGER_SECONDS)
                say("training finished")
                return 0
            if self.stopping.is_set():
                self._wait_for_members(plan.members, "closed", STOP_GRACE_SECONDS)
                say("stopped")
                return 0
            previous, generation = plan, plan.generation + 1
            if any(self.store.check([f"alive/{generation}/{slot}"]) for slot in previous.members):
                plan = self.plan(previous, generation)
            elif self._every_member_stalled(plan):
                plan = Plan(generation, [], -1, fallback=f"every rank of generation {plan.generation} stopped "
                                                         f"beating ({plan.members}): restarting the group whole")
                self._publish(plan)
            if plan.fallback:
                say(f"generation {plan.generation}: {plan.fallback}")
                # The store ends with this process: the ranks waiting for the plan must have read why first, or they
                # would report the store's loss instead.
                waiting = [slot for slot in previous.members if self.store.check([f"alive/{generation}/{slot}"])]
                self._wait_for_members(waiting, f"read/{generation}", LINGER_SECONDS)
                return 1
            time.sleep(JOIN_POLL_SECONDS)

    def plan(self, current: Plan, generation: int) -> Plan:
        """Wait for the old members and the joiners, then plan `generation` (or fall back past the deadline), and
        publish it."""
        started = last_change = time.monotonic()
        registered: dict[int, int] = {}
        while True:
            for slot in current.members:
                if slot not in registered and self.store.check([f"alive/{generation}/{slot}"]):
                    registered[slot] = int(self.store.get(f"alive/{generation}/{slot}"))
                    last_change = time.monotonic()
            joiners, asked = self._joiners()
            everyone = len(registered) == len(current.members)
            settled = time.monotonic() - last_change >= SETTLE_SECONDS
            plan = plan_generation(generation, current.members, registered, joiners, min_workers=self.min_workers,
                                   max_workers=self.max_workers, leaving=self._leaving(current))
            if (everyone or settled) and not plan.fallback:
                self._joins_taken = asked
                plan = self._unless_repeated(plan)
                break
            if time.monotonic() - started > self.deadline_seconds:
                plan = replace(plan, source=-1, fallback=f"{plan.fallback or 'the regroup did not complete'} within "
                                                         f"elastic.regroupDeadlineSeconds ({self.deadline_seconds:g}s)")
                break
            time.sleep(JOIN_POLL_SECONDS)
        self._publish(plan)
        if not plan.fallback:
            say(f"generation {generation}: slots {plan.members} from step {plan.step} (lost {plan.lost}, added "
                f"{sorted(plan.added)}, left {plan.left})")
        return plan

    def _unless_repeated(self, plan: Plan) -> Plan:
        self._regroups_at = [*self._regroups_at[-(REPEATS_BEFORE_RESTART - 1):], plan.step]
        if len(self._regroups_at) == REPEATS_BEFORE_RESTART and len(set(self._regroups_at)) == 1:
            return Plan(plan.generation, [], -1, fallback=f"the group was lost {REPEATS_BEFORE_RESTART} times at "
                                                          f"step {plan.step}: restarting it whole from its latest "
                                                          "checkpoint")
        return plan

    def _publish(self, plan: Plan) -> None:
        self.store.set(f"plan/{plan.generation}", plan.to_json())
        self.store.set("joins/planned", str(self._joins_taken))
        self.store.set("generation", str(plan.generation))

    def _leaving(self, current: Plan) -> frozenset[int]:
        return frozenset(slot for slot in current.members if self.store.check([f"leave/{slot}"]))

    def _joiners(self) -> tuple[dict[int, int], int]:
        """The slots asking to join since the last generation was planned, each with its latest incarnation; and the
        count of requests read."""
        slots, asked = {}, int(self.store.add("joins", 0))
        for index in range(self._joins_taken + 1, asked + 1):
            request = json.loads(self.store.get(f"join/{index}"))
            slots[request["slot"]] = request["incarnation"]
        return slots, asked

    def _every_member_stalled(self, plan: Plan) -> bool:
        """Whether no member of `plan` has beaten for STALL_SECONDS (none is left to register for a regroup)."""
        now = time.monotonic()
        stalled = True
        for slot in plan.members:
            count = int(self.store.add(f"beat/{slot}", 0))
            still = self._beats.still_for(slot, count, now)
            # A member that has not beaten yet is still starting (importing torch, loading its data).
            stalled = stalled and count > 0 and still > STALL_SECONDS + BEAT_SECONDS
        return stalled

    def _wait_for_members(self, slots: list[int], mark: str, seconds: float) -> None:
        """Wait, up to `seconds`, until each of `slots` has set `<mark>/<slot>`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not all(self.store.check([f"{mark}/{slot}"]) for slot in slots):
            time.sleep(JOIN_POLL_SECONDS)


def main() -> int:
    """Configured as a rank is, by the worker contract's variables: MASTER_PORT (where the store listens), WORLD_SIZE
    (the slots of generation 1) and TANDEM_SPEC (spec.elastic)."""
    try:
        port, workers = int(os.environ[MASTER_PORT]), int(os.environ[WORLD_SIZE])
        job = ParallelTrainingJob.model_validate_json(Path(os.environ[SPEC]).read_text(encoding="utf-8"))
    except (KeyError, ValueError, OSError) as error:
        raise ContractError(f"tandem worker coordinator needs {MASTER_PORT}, {WORLD_SIZE} and {SPEC} (the job's "
                            f"spec file): {type(error).__name__}: {error}") from error
    elastic = job.spec.elastic
    if elastic is None:
        raise ContractError(f"tandem worker coordinator serves an elastic job; {os.environ[SPEC]} has no "
                            "spec.elastic")
    coordinator = Coordinator(workers=workers, min_workers=elastic.min_workers,
                              max_workers=elastic.max_workers or sys.maxsize, port=port,
                              deadline_seconds=elastic.regroup_deadline_seconds)
    signal.signal(signal.SIGTERM, lambda signum, frame: coordinator.stopping.set())
    return coordinator.run()


def cli() -> int:
    try:
        return main()
    except ContractError as error:
        print(f"tandem worker coordinator: {error}", file=sys.stderr, flush=True)
        return 2
