"""The elastic job's coordinator (worker/train/coordinator.py) on a real TCP store, its ranks played by this test
through a store client writing what membership.py's ranks write: heartbeats, registrations for the next generation,
join and leave requests, `finished` and `closed`. No process group is formed: the planning alone is under test."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tandem.worker.train.coordinator import REPEATS_BEFORE_RESTART, Coordinator
from tandem.worker.train.membership import Plan
from tandem.worker.train.process_group import free_port


class Ranks:
    """The ranks' side of the store, as membership.py writes it."""

    def __init__(self, port: int):
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))

    def beat(self, *slots: int) -> None:
        for slot in slots:
            self.store.add(f"beat/{slot}", 1)

    def register(self, generation: int, slot: int, step: int) -> None:
        self.store.set(f"alive/{generation}/{slot}", str(step))

    def ask_to_join(self, slot: int, incarnation: int) -> None:
        index = int(self.store.add("joins", 1))
        self.store.set(f"join/{index}", json.dumps({"slot": slot, "incarnation": incarnation}))

    def plan(self, generation: int, timeout: float = 10.0) -> Plan:
        deadline = time.monotonic() + timeout
        while not self.store.check([f"plan/{generation}"]):
            assert time.monotonic() < deadline, f"no plan for generation {generation}"
            time.sleep(0.01)
        return Plan.from_json(self.store.get(f"plan/{generation}"))

    def read_fallback(self, generation: int, *slots: int) -> None:
        for slot in slots:
            self.store.set(f"read/{generation}/{slot}", "1")

    def joins_waiting(self) -> bool:
        """What rank 0 asks at each agreement (Membership.regroup_wanted)."""
        return int(self.store.add("joins", 0)) > int(self.store.get("joins/planned"))


def start_coordinator(*, min_workers: int, deadline_seconds: float
                      ) -> tuple[Coordinator, Ranks, list[int], threading.Thread]:
    """A coordinator of two slots running on a thread, the ranks' side of its store, and its exit code once it
    ends."""
    port = free_port()
    coordinator = Coordinator(workers=2, min_workers=min_workers, max_workers=2, port=port,
                              deadline_seconds=deadline_seconds)
    ended: list[int] = []
    thread = threading.Thread(target=lambda: ended.append(coordinator.run()), daemon=True)
    thread.start()
    return coordinator, Ranks(port), ended, thread


@pytest.fixture
def coordinated():
    """A coordinator of two slots (minWorkers 1, deadline 3 s), stopped after the test."""
    coordinator, ranks, ended, thread = start_coordinator(min_workers=1, deadline_seconds=3.0)
    yield ranks, ended, thread
    coordinator.stopping.set()  # as SIGTERM: it serves on until the members close
    if thread.is_alive():
        for slot in (0, 1):
            ranks.store.set(f"closed/{slot}", "1")
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_slot_0_lost_then_replaced_slot_1_is_rank_0_in_between(coordinated):
    ranks, ended, _ = coordinated
    assert ranks.plan(1) == Plan(1, [0, 1], 0, {0: 0, 1: 0})
    ranks.register(2, 1, step=61)  # slot 0 is lost: it never registers
    second = ranks.plan(2)
    assert (second.members, second.source, second.lost, second.step) == ([1], 1, [0], 61)
    ranks.ask_to_join(0, incarnation=2)
    assert ranks.joins_waiting(), "rank 0 of generation 2 (slot 1) sees the replacement waiting"
    ranks.register(3, 1, step=73)
    third = ranks.plan(3)
    assert (third.members, third.added, third.source, third.step) == ([0, 1], {0: 2}, 1, 73)
    assert third.receives_state(0) and not third.receives_state(1)
    assert not ranks.joins_waiting()
    assert ended == []


def test_a_leaver_is_left_out_and_the_training_finished_ends_it_once_the_members_close(coordinated):
    ranks, ended, thread = coordinated
    ranks.plan(1)
    ranks.store.set("leave/1", "1")
    for slot in (0, 1):
        ranks.register(2, slot, step=20)
    second = ranks.plan(2)
    assert (second.members, second.left, second.lost) == ([0], [1], [])
    ranks.store.set("finished", "1")
    time.sleep(0.3)
    assert thread.is_alive(), "it waits for the members to close (a joiner still asks it whether the job is over)"
    ranks.store.set("closed/0", "1")
    thread.join(timeout=5)
    assert ended == [0]


def test_the_group_lost_again_and_again_at_one_step_falls_back_to_a_restart(coordinated):
    ranks, ended, thread = coordinated
    ranks.plan(1)
    for generation in range(2, 2 + REPEATS_BEFORE_RESTART):
        for slot in (0, 1):
            ranks.register(generation, slot, step=30)
        plan = ranks.plan(generation)
    assert plan.fallback.startswith(f"the group was lost {REPEATS_BEFORE_RESTART} times at step 30"), plan
    ranks.read_fallback(generation, 0, 1)
    thread.join(timeout=5)
    assert ended == [1]


def test_fewer_than_min_workers_past_the_deadline_falls_back_to_a_restart_once_the_rank_left_has_read_why():
    _, ranks, ended, thread = start_coordinator(min_workers=2, deadline_seconds=1.0)
    ranks.plan(1)
    ranks.register(2, 0, step=5)
    plan = ranks.plan(2)
    assert plan.fallback == ("1 rank(s) left, fewer than elastic.minWorkers (2) within "
                             "elastic.regroupDeadlineSeconds (1s)"), plan
    time.sleep(0.3)
    assert thread.is_alive(), "the store is kept until the rank waiting for the plan has read why (not its loss)"
    ranks.read_fallback(2, 0)
    thread.join(timeout=5)
    assert ended == [1]


def test_every_member_stalled_falls_back_to_a_restart_but_not_before_they_beat(coordinated):
    ranks, ended, thread = coordinated
    ranks.plan(1)
    time.sleep(2.5)  # past the stall time: members still starting (importing torch) have not beaten yet
    assert thread.is_alive() and not ranks.store.check(["plan/2"])
    ranks.beat(0, 1)  # both beat once, then stop (a node with every rank lost)
    plan = ranks.plan(2, timeout=10)
    assert plan.fallback.startswith("every rank of generation 1 stopped beating"), plan
    thread.join(timeout=5)
    assert ended == [1]
