"""The trade of workers between an elastic job and the InferencePools it lends to (operator/lending.py), without a
cluster: what a selected pool is short of, how much it borrows, when the job takes its workers back, and the
status.borrowed the pool shows; table-driven where the cases share a shape."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import pytest

from tandem.api.training import LendTo
from tandem.operator import lending
from tandem.operator.lending import Borrower, borrowed, borrowers

NOW = datetime(2026, 12, 4, 12, 0, 0, tzinfo=UTC)
trade = partial(lending.trade, placement_seconds=60)
"""lendTo's placementDeadlineSeconds at its default."""
LEND_TO = LendTo.model_validate({"poolSelector": {"matchLabels": {"tier": "online"}},
                                 "stabilizationWindowSeconds": 60})
SHORT = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."


def ago(seconds: float) -> str:
    return (NOW - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def rank_pod(gpus: str = "1") -> dict[str, Any]:
    return {"spec": {"containers": [{"resources": {"requests": {"cpu": "4"}, "limits": {"nvidia.com/gpu": gpus}}}]}}


def server(name: str, *, placed: bool = True, message: str | None = None, gpus: str = "1",
           terminating: bool = False) -> dict[str, Any]:
    """A pool's server pod: placed on a node, or Pending with the scheduler's `message`."""
    pod: dict[str, Any] = {"metadata": {"name": name},
                           "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": gpus}}}]},
                           "status": {"phase": "Running" if placed else "Pending"}}
    if placed:
        pod["spec"]["nodeName"] = "tandem-node"
    elif message is not None:
        pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                        "message": message}]
    if terminating:
        pod["metadata"]["deletionTimestamp"] = ago(1)
    return pod


def pool(name: str, replicas: int, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"tier": "online"} if labels is None else labels},
            "spec": {"replicas": replicas}}


BORROWER_CASES = [
    ("a replica short of the GPUs the ranks hold", [server("a"), server("b", placed=False, message=SHORT)], "1",
     (2, 1, 1.0)),
    ("two replicas of two GPUs each, ranks of one", [server("a", gpus="2"),
                                                      server("b", placed=False, message=SHORT, gpus="2"),
                                                      server("c", placed=False, message=SHORT, gpus="2")], "1",
     (3, 2, 2.0)),
    ("a replica of one GPU, ranks of two", [server("a"), server("b", placed=False, message=SHORT)], "2",
     (2, 1, 0.5)),
    ("short of memory, which the ranks hold none of",
     [server("a"), server("b", placed=False, message="0/1 nodes are available: 1 Insufficient memory.")], "1",
     (2, 0, 0.0)),
    ("short of cpu, which the ranks hold", [server("a"), server("b", placed=False, message=(
        "0/2 nodes are available: 1 Insufficient cpu, 1 node(s) were not ready."))], "1", (2, 1, 0.0)),
    ("pending, not yet tried by the scheduler", [server("a"), server("b", placed=False)], "1", (2, 0, 0.0)),
    ("a terminating replica is not the pool's", [server("a"), server("b", terminating=True)], "1", (1, 0, 0.0)),
]


@pytest.mark.parametrize(("name", "pods", "rank_gpus", "expected"), BORROWER_CASES,
                         ids=[case[0] for case in BORROWER_CASES])
def test_a_selected_pool_is_short_of_what_the_ranks_hold(name, pods, rank_gpus, expected):
    [found] = borrowers(LEND_TO, [pool("online", len(pods))], {"online": pods}, rank_pod(rank_gpus))
    assert (found.pods, found.short, found.workers_per_replica) == expected


def test_only_pools_whose_labels_match_the_selector_borrow_and_none_without_a_rank_pod():
    pools = [pool("online", 2), pool("batch", 2, {"tier": "batch"}), pool("bare", 2, {})]
    pods = {name: [server("a"), server("b", placed=False, message=SHORT)] for name in ("online", "batch", "bare")}
    assert [b.name for b in borrowers(LEND_TO, pools, pods, rank_pod())] == ["online"]
    everything = LendTo.model_validate({"poolSelector": {}})
    assert [b.name for b in borrowers(everything, pools, pods, rank_pod())] == ["bare", "batch", "online"]
    assert borrowers(LEND_TO, pools, pods, None)[0].short == 0, "no rank pod: nothing known to be held"


def loan(workers: int = 1, base: int = 1, per_replica: float = 1.0, surplus: float | None = None,
         name: str = "online") -> dict[str, Any]:
    entry = {"name": name, "workers": workers, "baseReplicas": base, "workersPerReplica": per_replica}
    if surplus is not None:
        entry["surplusSince"] = ago(surplus)
    return entry


def lent(*loans: dict[str, Any], since: float = 120) -> dict[str, Any]:
    return {"workers": sum(entry["workers"] for entry in loans), "to": [entry["name"] for entry in loans],
            "since": ago(since), "pools": list(loans)}


def online(replicas: int, pods: int | None = None, short: int = 0, per_replica: float = 1.0) -> Borrower:
    return Borrower("online", replicas, replicas if pods is None else pods, short, per_replica if short else 0.0)


TRADE_CASES = [
    # name, loan before, borrowers, spare, may_lend, expected loan (workers per pool), expected Event reasons
    ("nothing short, nothing lent", None, [online(1)], 2, True, {}, []),
    ("one replica short: one worker lent", None, [online(2, short=1)], 2, True, {"online": 1}, ["Lent"]),
    ("two replicas short: two lent", None, [online(3, short=2)], 2, True, {"online": 2}, ["Lent"]),
    ("short, but the job is at minWorkers", None, [online(2, short=1)], 0, True, {}, []),
    ("short of more than the job can spare", None, [online(4, short=3)], 2, True, {"online": 2}, ["Lent"]),
    ("short while the group is not at its size: nothing lent", None, [online(2, short=1)], 2, False, {}, []),
    ("the lent replica still pending: not lent twice", lent(loan()), [online(2, short=1)], 2, True,
     {"online": 1}, []),
    ("more replicas short beyond the loan", lent(loan()), [online(3, short=2)], 2, True, {"online": 2}, ["Lent"]),
    ("replicas of two GPUs, ranks of one: two workers a replica", None, [online(2, short=1, per_replica=2.0)], 3,
     True, {"online": 2}, ["Lent"]),
    ("a rolling update's surge pod short: no demand beyond the replicas", None, [online(2, pods=3, short=1)], 2,
     True, {}, []),
    ("demand held: the loan is kept", lent(loan()), [online(2)], 2, True, {"online": 1}, []),
    ("demand fell inside the window: kept", lent(loan(surplus=30)), [online(1)], 2, True, {"online": 1}, []),
    ("demand fell past the window: taken back", lent(loan(surplus=60)), [online(1)], 2, True, {}, ["TookBack"]),
    ("demand fell by one of two past the window", lent(loan(workers=2, surplus=90)), [online(2)], 2, True,
     {"online": 1}, ["TookBack"]),
    ("the pool gone: taken back at once", lent(loan()), [], 2, True, {}, ["TookBack"]),
    ("the job scaled down under its loan: taken back to what it can spare", lent(loan(workers=2, base=1)),
     [online(3)], 1, True, {"online": 1}, ["TookBack"]),
]


@pytest.mark.parametrize(("name", "before", "pools", "spare", "may_lend", "expected", "reasons"), TRADE_CASES,
                         ids=[case[0] for case in TRADE_CASES])
def test_trade(name, before, pools, spare, may_lend, expected, reasons):
    after = trade(before, pools, spare=spare, may_lend=may_lend, window_seconds=60, now=NOW)
    assert {entry["name"]: entry["workers"] for entry in (after.lent or {}).get("pools", [])} == expected
    assert [reason for _, reason, _ in after.events] == reasons
    assert after.workers == sum(expected.values())
    if after.lent:
        assert after.lent["to"] == list(expected)


def test_a_loan_begins_at_the_replicas_placed_and_its_clock_and_start_are_kept():
    first = trade(None, [online(3, short=2)], spare=3, may_lend=True, window_seconds=60, now=NOW)
    assert first.lent == {"workers": 2, "to": ["online"], "since": ago(0), "pools": [
        {"name": "online", "workers": 2, "baseReplicas": 1, "workersPerReplica": 1.0}], "unplaceable": []}
    assert first.events[0][2].startswith("Lent 2 workers to InferencePool online: 2 replicas could not be placed")
    dipped = trade(first.lent, [online(2)], spare=3, may_lend=True, window_seconds=60, now=NOW + timedelta(seconds=5))
    assert dipped.lent["pools"][0]["surplusSince"] == ago(-5) and dipped.lent["since"] == ago(0)
    assert dipped.look_again == 60, "look again when the window runs out"
    waiting = trade(dipped.lent, [online(2)], spare=3, may_lend=True, window_seconds=60,
                    now=NOW + timedelta(seconds=45))
    assert waiting.look_again == 20 and waiting.workers == 2
    back = trade(dipped.lent, [online(3)], spare=3, may_lend=True, window_seconds=60, now=NOW + timedelta(seconds=9))
    assert "surplusSince" not in back.lent["pools"][0], "demand back within the window: the clock starts again"
    later = trade(back.lent, [online(1)], spare=3, may_lend=True, window_seconds=60, now=NOW + timedelta(seconds=20))
    gone = trade(later.lent, [online(1)], spare=3, may_lend=True, window_seconds=60, now=NOW + timedelta(seconds=80))
    assert gone.lent is None
    assert gone.events == [("Normal", "TookBack", "Took back 2 workers from InferencePool online: its demand fell to "
                                                  "0 for 60 s (spec.elastic.lendTo.stabilizationWindowSeconds); "
                                                  "they join at a step boundary")]


def test_a_second_lender_covers_only_what_the_first_left_short_and_is_given_back_first():
    """Job a lent one worker (the pool had 1 replica placed); the pool grows to 3 and a cannot spare more: job b's
    loan begins at the 2 replicas then placed. The pool falling to 2 ends b's demand, not a's."""
    a = lent(loan(base=1))
    b = trade(None, [online(3, short=1)], spare=1, may_lend=True, window_seconds=0, now=NOW)
    assert b.lent["pools"][0]["baseReplicas"] == 2 and b.workers == 1
    assert trade(a, [online(2)], spare=1, may_lend=True, window_seconds=0, now=NOW).workers == 1
    assert trade(b.lent, [online(2)], spare=1, may_lend=True, window_seconds=0, now=NOW).workers == 0


def test_a_second_lender_does_not_lend_for_the_replica_a_first_loan_in_flight_pays_for():
    """Job a has just lent one worker for the pool's pending replica (its rank still leaving, the replica still
    short): job b, deciding next, counts a's loan (the pool's `covered`) and lends nothing for that replica, only for
    one beyond it, its loan beginning where a's reaches."""
    pods = [server("a"), server("b", placed=False, message=SHORT)]
    others = [lent(loan(base=1)), None]  # job a's, and a job that lends nothing
    [found] = borrowers(LEND_TO, [pool("online", 2)], {"online": pods}, rank_pod(), others)
    assert (found.short, found.covered) == (1, 2)
    assert trade(None, [found], spare=2, may_lend=True, window_seconds=60, now=NOW).lent is None
    [grown] = borrowers(LEND_TO, [pool("online", 3)], {"online": [*pods, server("c", placed=False, message=SHORT)]},
                        rank_pod(), others)
    second = trade(None, [grown], spare=2, may_lend=True, window_seconds=60, now=NOW)
    assert second.workers == 1 and second.lent["pools"][0]["baseReplicas"] == 2
    [halves] = borrowers(LEND_TO, [pool("online", 3)], {"online": pods}, rank_pod(),
                         [lent(loan(workers=3, base=1, per_replica=2.0))])
    assert halves.covered == 2, "3 workers at 2 a replica pay for 1 replica"


def test_a_pool_shows_what_it_borrows_from_each_job():
    def job(name: str, status: dict[str, Any] | None) -> dict[str, Any]:
        return {"metadata": {"name": name}, **({"status": status} if status is not None else {})}

    jobs = [job("b", {"lent": lent(loan(name="online"), loan(name="other"), since=30)}),
            job("a", {"lent": lent(loan(workers=2, name="online"), since=90)}), job("c", {}), job("d", None)]
    assert borrowed("online", jobs) == {"workers": 3, "from": ["a", "b"], "since": ago(90), "unplaceableFor": []}
    assert borrowed("other", jobs) == {"workers": 1, "from": ["b"], "since": ago(30), "unplaceableFor": []}
    assert borrowed("idle", jobs) is None
    stuck = [job("c", {"lent": {"workers": 0, "to": [], "pools": [], "unplaceable": [
        {"name": "pinned", "placement": "p", "since": ago(5)}]}}), *jobs]
    assert borrowed("pinned", stuck) == {"workers": 0, "from": [], "since": None, "unplaceableFor": ["c"]}
    assert borrowed("online", stuck) == borrowed("online", jobs)


def test_a_pool_that_places_nothing_with_the_lent_worker_free_gives_it_back_and_is_lent_nothing_more():
    """The lent rank's pod gone (the group at its size), the pool's replica still unplaced (its nodeSelector keeps
    it off the ranks' node, say): placementDeadlineSeconds (60 s by default) later the loan is taken back, and the
    pool is lent nothing more while it stays short with its pods placed so; changed there (another nodeSelector), or
    no longer short, it may borrow again."""
    before = lent(loan())
    stuck = Borrower("online", 2, 2, 1, 1.0, "pinned")
    leaving = trade(before, [stuck], spare=2, may_lend=False, window_seconds=60, now=NOW)
    assert "unplacedSince" not in leaving.lent["pools"][0], "no clock while the lent rank is still leaving"
    first = trade(before, [stuck], spare=2, may_lend=True, window_seconds=60, now=NOW)
    assert first.lent["pools"][0]["unplacedSince"] == ago(0) and first.look_again == 60
    placed = trade(first.lent, [Borrower("online", 2, 2, 0, 0.0)], spare=2, may_lend=True, window_seconds=60,
                   now=NOW + timedelta(seconds=5))
    assert "unplacedSince" not in placed.lent["pools"][0], "placed: the loan did its work"
    waiting = trade(first.lent, [stuck], spare=2, may_lend=True, window_seconds=60, now=NOW + timedelta(seconds=45))
    assert waiting.workers == 1 and waiting.look_again == 15
    back = trade(first.lent, [stuck], spare=2, may_lend=True, window_seconds=60,
                 now=NOW + timedelta(seconds=60))
    assert back.lent == {"workers": 0, "to": [], "since": None, "pools": [],
                         "unplaceable": [{"name": "online", "placement": "pinned", "since": ago(-60)}]}
    assert back.events == [("Normal", "TookBack", (
        "Took back 1 worker from InferencePool online: none of its replicas was placed in 60 s with them free, so "
        "its pods cannot run where the ranks ran (compare its nodeSelector, affinity and tolerations with the "
        "job's); it is lent nothing more while its pods stay short and placed so; they join at a step boundary"))]
    later = NOW + timedelta(seconds=90)
    assert trade(back.lent, [stuck], spare=2, may_lend=True, window_seconds=60, now=later).lent == back.lent
    fixed = trade(back.lent, [Borrower("online", 2, 2, 1, 1.0, "anywhere")], spare=2, may_lend=True,
                  window_seconds=60, now=later)
    assert fixed.workers == 1 and fixed.lent["unplaceable"] == [] and fixed.events[0][1] == "Lent"
    assert trade(back.lent, [online(1)], spare=2, may_lend=True, window_seconds=60, now=later).lent is None


def test_a_pools_short_pods_are_told_apart_by_where_they_may_run():
    def short(name: str, **spec: Any) -> dict[str, Any]:
        pod = server(name, placed=False, message=SHORT)
        pod["spec"].update(spec)
        return pod

    def placement(*pods: dict[str, Any]) -> str:
        [found] = borrowers(LEND_TO, [pool("online", len(pods))], {"online": list(pods)}, rank_pod())
        return found.placement

    serving = {"nodeSelector": {"pool": "serving"}}
    assert placement(server("a")) == "", "nothing short: nowhere asked"
    assert placement(server("a"), short("b", **serving)) == placement(short("c", **serving))
    assert placement(short("b", **serving)) != placement(short("b"))
    assert placement(short("b", tolerations=[{"key": "gpu", "operator": "Exists"}])) != placement(short("b"))
