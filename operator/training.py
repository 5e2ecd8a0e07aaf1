"""A ParallelTrainingJob's decisions, as one pure function: (the job, its rank pods, its spec ConfigMap, the clock)
-> a Plan (objects to create, pods to delete, the operator's status fields, events, when to look again).

The operator writes phase, conditions, workers, master, restarts, startTime, completionTime, message,
observedGeneration, selector, queue and lent; rank 0 writes progress, metrics, communication, checkpoint and
preemptionCost. Neither writes the other's fields (a merge patch of its own), but for rank 0's ETA, which the
operator removes once the job is not Running (training_plan.eta_removal). Before the rules, an elastic job that
lends to InferencePools (spec.elastic.lendTo) decides its loan (lending.py; refused under Kueue, LendingRefused):
the group's size below is spec.workers less the ranks lent. The rules, in the order they apply:

1. A manifest the API models reject gets an InvalidSpec condition naming each field; nothing else happens.
2. Succeeded or Failed is final: rank pods still running are deleted (their GPUs released; finished pods stay for
   their logs), and `ttlSecondsAfterFinished` after completion the job itself is deleted.
3. Past `activeDeadlineSeconds`: Failed (DeadlineExceeded), pods deleted.
4. `suspend: true`: the pods are deleted (SIGTERM: the ranks checkpoint), phase Suspended (a queued job leaves its
   queue: its Workload is deleted once the pods are gone); `suspend: false` starts a group again from the latest
   checkpoint, with the spec as it is then.
4a. A job labelled `kueue.x-k8s.io/queue-name` runs only while Kueue admits its Workload (training_queue.py):
   until then, and once evicted, it is Queued with no pods (an evicted group is stopped as a suspension stops it,
   and its quota given back once every pod is gone); admitted, a group starts from the latest checkpoint on the
   assigned flavours. A group whose pod set changed (a resize) queues again with a new Workload. `spec.gang` needs
   the operator's gang scheduling (--gang-scheduling): the group's PodGroup is created with it.
5. A running group whose trainer, image, GPUs or other group settings changed (found by the hash of its spec, on
   its ConfigMap: RunningGroup) keeps running as it was, with a SpecChangeRefused condition (suspend and resume the
   job to apply them); a changed `workers` (`kubectl scale`) or `ranksPerPod` restarts it regrouped from the latest
   checkpoint.
6. A rank that fails (in a pod of several, its launcher ends the pod and names it), a rank pod deleted or evicted,
   or rank 0 silent past `heartbeatTimeoutSeconds`, fails the group (an elastic job's, recovery regroup: its
   coordinator failed, deleted or gone, or a rank that cannot be replaced alone; any other rank's pod is replaced
   alone while the others regroup): every pod is deleted, and once they are gone
   and the backoff has passed a new group starts from `status.checkpoint.latest` (tandem/restart_policy.py), until
   `backoffLimit` restarts are spent: Failed. A rank that met a permanent failure (its exit code and report say so:
   a model or data that cannot work, InvalidModelOrData; a checkpoint directory not the run's to write,
   CheckpointDirectoryTaken) fails the job at once with that reason, its report leading the message: a restart
   would fail the same way.
7. Otherwise the phase follows the pods (workers / ranksPerPod of them, and an elastic job's coordinator): Pending
   (with the scheduler's or the kubelet's reason), Running once every pod runs, Succeeded when every rank pod exited
   0, or an elastic job's coordinator did (it ends once the training is over).
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from tandem.api import ParallelTrainingJob
from tandem.api.training import TRAINING_PHASES
from tandem.contract import GROUP_RESTART_EXIT_CODE, RESUME_LATEST, PermanentFailureReport
from tandem.operator import queueing
from tandem.operator.lending import Borrower, Trade, trade
from tandem.operator.observed import (
    ParsedResource,
    RankPod,
    condition,
    isoformat,
    observe_pod,
    timestamp,
    with_condition,
)
from tandem.operator.training_objects import (
    MASTER_PORT,
    applied_job,
    changed_fields,
    coordinator_name,
    coordinator_pod,
    group_master,
    group_objects,
    is_coordinator,
    pod_name,
    rank_selector_string,
    running_group,
    worker_pod,
)
from tandem.operator.training_plan import Plan, Queueing, Settings, eta_removal
from tandem.operator.training_queue import QueueRules
from tandem.restart_policy import after_failure, backoff_seconds, deadline_exceeded, heartbeat_expired, seconds_left

PEER_WAIT_SECONDS = 3.0
"""How long a group whose only failed pods lost a peer (RankPod.lost_a_peer) waits for the pod that failed first to
report it: a pod of several ranks ends a moment after its failed rank (its launcher stops the others), later than a
peer that raised."""
WAIT_SECONDS = 1.0
"""How soon to look again while pods are on their way out."""
WATCH_SECONDS = 5.0
"""How soon to look again while a group runs (heartbeat and deadline); pod changes come sooner, as events."""


def regroups_reported(status: dict[str, Any]) -> int:
    """status.recoveries.regroups: the regroups in process rank 0 reported (0 before any)."""
    return int((status.get("recoveries") or {}).get("regroups") or 0)


def regroup_events(status: dict[str, Any], seen: int | None) -> list[tuple[str, str, str]]:
    """The Event for the regroups rank 0 reported since `seen` (status.recoveries.regroups at the last look; None: no
    look yet, nothing to tell), from its status.lastRecovery."""
    regroups = regroups_reported(status)
    last = status.get("lastRecovery") or {}
    if seen is None or regroups <= seen or last.get("kind") != "regroup":
        return []
    changes = [f"lost rank(s) {', '.join(map(str, last['lost']))}" if last.get("lost") else "",
               f"added rank(s) {', '.join(map(str, last['added']))}" if last.get("added") else "",
               last.get("message") or ""]
    change = "; ".join(part for part in changes if part) or "no change"
    several = f"{regroups - seen} regroups since the last look; the latest: " if regroups - seen > 1 else ""
    took = f" in {last['seconds']:.2f} s" if last.get("seconds") is not None else ""
    return [("Normal", "Regrouped", f"{several}{change}: {last.get('workers')} rank(s) train on from step "
                                    f"{last.get('resumedAtStep')}{took}, nothing restarted (spec.elastic)")]


def reconcile(job: ParsedResource, pods: list[dict[str, Any]], config_map: dict[str, Any] | None, now: datetime,
              settings: Settings, queued: Queueing | None = None, borrowers: list[Borrower] | None = None) -> Plan:
    """`borrowers`: the InferencePools the job's spec.elastic.lendTo selects, with their demand (lending.py)."""
    return _Reconciler(job, pods, config_map, now, settings, queued or Queueing(), borrowers or []).plan()


class _Reconciler(QueueRules):
    def __init__(self, job: ParsedResource, pods: list[dict[str, Any]], config_map: dict[str, Any] | None,
                 now: datetime, settings: Settings, queued: Queueing, borrowers: list[Borrower]):
        self.parsed, self.body, self.now, self.settings, self.queued = job, job.body, now, settings, queued
        self.borrowers = borrowers
        self.queue = queueing.queue_name(self.body)
        self.queue_status: dict[str, Any] | None = None
        self.admitted = False
        """The group runs under a Kueue admission."""
        self.status = dict(self.body.get("status") or {})
        self.phase = self.status.get("phase") or "Pending"
        self.conditions = list(self.status.get("conditions") or [])
        self.restarts = int(self.status.get("restarts") or 0)
        self.recovery_read = self.status.get("lastRecovery")
        """rank 0 writes a regroup's: the operator sends lastRecovery only when it changed it (a restart)."""
        self.pods = sorted((observe_pod(p) for p in pods if not is_coordinator(p)), key=lambda p: p.index)
        """The rank pods."""
        self.coordinator = next((observe_pod(p) for p in pods if is_coordinator(p)), None)
        """An elastic job's coordinator pod (spec.regroups), once created."""
        self.children = self.pods + ([self.coordinator] if self.coordinator is not None else [])
        """Every pod of the group: what a teardown deletes and waits for."""
        self.live = [p for p in self.children if p.live]
        self.config_map = config_map
        self.result = Plan()
        self.loan = Trade(self.status.get("lent"))
        """What the job lends to InferencePools (spec.elastic.lendTo), as decided in this pass."""

    # -- the rules ---------------------------------------------------------------------------------------------

    def plan(self) -> Plan:
        if self.parsed.model is None:
            return self._invalid(self.parsed.problems)
        self.job: ParallelTrainingJob = self.parsed.model
        self.spec = self.job.spec
        self._clear("InvalidSpec", "SpecValid", "the spec is valid")
        self.lent_before = self.loan.workers
        self._lend()
        self.size = self.spec.pods - self.loan.workers
        """The rank pods the group has (or starts with) now: spec.workers less those lent."""
        if self.phase in ("Succeeded", "Failed"):
            self._finished()
        elif deadline_exceeded(timestamp(self.status.get("startTime")), self.spec.active_deadline_seconds, self.now):
            self._fail("DeadlineExceeded", f"the job ran past activeDeadlineSeconds "
                                           f"({self.spec.active_deadline_seconds} s)")
        elif self.spec.suspend:
            self._suspend()
        elif not self._may_run():
            pass
        elif self.phase in ("Suspended", "Queued"):
            self._resume()
        elif self.phase == "Restarting":
            self._restart_when_ready()
        elif not self.children:
            self._start_group(self.job, "Created", f"starting {self.spec.workers} ranks")
        elif (resize := self._resize()) is not None and not self.spec.regroups:
            self._tear_down("Resizing", resize)
        elif self._coordinator_done():
            self._succeeded("the group's coordinator exited 0: training complete")
        elif self.spec.regroups and self._follow_elastic_ranks():
            pass
        elif (lost := self._coordinator_lost()) is not None:
            self._group_failed(lost, False, None)
        elif self._cause_on_its_way():
            self.result.requeue_after = WAIT_SECONDS
        elif (failure := self._failure()) is not None:
            self._group_failed(*failure)
        else:
            self._follow_pods()
        return self._finish()

    def _lend(self) -> None:
        """spec.elastic.lendTo: what the job lends after this look (lending.py), and the group's size with it. Not
        with Kueue (LendingRefused): Kueue charges the job's ClusterQueue for the size it admitted, an admitted
        Workload's pod counts are fixed, and a pool's pods are not in the queue, so a lent worker would serve on
        quota Kueue still counts as the job's; the alternative, a new Workload for every trade, would requeue the
        group (a restart), which the trade exists to avoid."""
        lend_to = self.spec.elastic.lend_to if self.spec.elastic is not None else None
        if lend_to is None and not self.loan.lent:
            return
        if self.phase in ("Succeeded", "Failed"):
            self.loan = Trade(None)
            return
        refused = lend_to is not None and self.queue is not None
        if refused:
            self.conditions = with_condition(
                self.conditions, "LendingRefused", True, "KueueManaged",
                f"spec.elastic.lendTo is not applied while Kueue manages the job (label {queueing.QUEUE_LABEL}): "
                "Kueue charges its ClusterQueue for the size it admitted and cannot shrink an admitted Workload, so a "
                "worker lent to a pool outside the queue would serve on quota still counted as the job's; remove the "
                "label or lendTo", self.now)
        else:
            self._clear("LendingRefused", "Lending", "the job lends as spec.elastic.lendTo says")
        min_workers = self.spec.elastic.min_workers if self.spec.elastic is not None else self.spec.workers
        ranks_at_least = math.ceil(min_workers / self.spec.ranks_per_pod)
        self.loan = trade(self.status.get("lent"), [] if lend_to is None or refused else self.borrowers,
                          spare=max(0, self.spec.pods - ranks_at_least), may_lend=self._at_size(),
                          window_seconds=lend_to.stabilization_window_seconds if lend_to else 0, now=self.now,
                          placement_seconds=lend_to.placement_deadline_seconds if lend_to else 0)
        self.result.events += self.loan.events

    def _at_size(self) -> bool:
        """Whether the group runs at its size, no rank coming or going: a time to lend ranks (they leave at a step
        boundary)."""
        return (self.phase == "Running" and not self.spec.suspend and self.coordinator is not None
                and self.coordinator.phase == "Running" and not self.coordinator.terminating
                and [p.index for p in self.pods] == list(range(self.spec.pods - self.lent_before))
                and all(p.phase == "Running" and not p.terminating for p in self.pods))

    def _invalid(self, problems: list[str]) -> Plan:
        message = "; ".join(problems)
        if not (previous := condition(self.conditions, "InvalidSpec")) or previous.get("message") != message:
            self.result.events.append(("Warning", "InvalidSpec", message))
        self.conditions = with_condition(self.conditions, "InvalidSpec", True, "InvalidSpec", message, self.now)
        self.result.status = {"conditions": self.conditions, "message": f"invalid spec: {message}"}
        return self.result

    def _finished(self) -> None:
        self._delete(p for p in self.live)
        if self.queued.workload is not None:
            self._admission()
            self.result.workload_status = queueing.finished(
                self.queued.workload, self.phase == "Succeeded", self.status.get("message") or self.phase, self.now)
        ttl = self.spec.ttl_seconds_after_finished
        completed = timestamp(self.status.get("completionTime"))
        if ttl is not None and completed is not None:
            left = ttl - (self.now - completed).total_seconds()
            if left <= 0:
                self.result.delete_job = True
            else:
                self.result.requeue_after = left

    def _suspend(self) -> None:
        self._delete(p for p in self.children if not p.terminating)
        self.result.stop_first = True
        waiting = [p for p in self.pods if not p.finished]
        message = f"suspended: {len(waiting)} rank(s) stopping" if waiting else "suspended"
        if self.queue is not None:
            message += f" (out of queue {self.queue} until resumed)"
            if not self.children and self.queued.workload is not None:
                self.result.delete_workload = self.queued.workload["metadata"]["name"]
        self._set_phase("Suspended", "Suspended", message)
        if any(not p.finished for p in self.children):
            self.result.requeue_after = WAIT_SECONDS

    def _resume(self) -> None:
        """`suspend: false` again, or admitted by Kueue: once the stopped ranks are gone, a group starts with the spec
        as it is now."""
        if self.children:
            self._delete(p for p in self.children if not p.terminating)
            self.result.requeue_after = WAIT_SECONDS
            return
        if self.phase == "Queued":
            self._start_group(self.job, "Admitted", f"admitted by Kueue in {self.queued_in()}: starting the ranks "
                                                    "from the latest checkpoint")
        else:
            self._start_group(self.job, "Resumed", "resumed: starting the ranks from the latest checkpoint")

    def _held(self, phase: str, reason: str, message: str) -> bool:
        """Stop the group if it runs (as a suspension does: SIGTERM, the ranks checkpoint) and wait in `phase`."""
        stopping = [p for p in self.pods if not p.finished]
        if self.children:
            self._delete(p for p in self.children if not p.terminating)
            self.result.stop_first = True
            self.result.requeue_after = WAIT_SECONDS
        if stopping:
            message += f"; {len(stopping) * self.spec.ranks_per_pod} rank(s) stopping (they checkpoint)"
        self._set_phase(phase, reason, message, warning=phase == "Queued" and bool(stopping))
        if self.queue_status is not None and self.queued.workload is None:  # no word from Kueue: the operator's
            self.queue_status.update(reason=reason, message=message)
        self.result.requeue_after = self.result.requeue_after or WATCH_SECONDS
        return False

    def _next_group(self) -> ParallelTrainingJob:
        """The spec the next group runs: while a group runs or restarts (after a failure or for a resize), the
        running group's (a refused change stays refused) at the size and layout the job asks for; otherwise (a first
        group, one resumed or admitted) the job as it is now."""
        running = running_group(self.config_map) if self.children or self.phase == "Restarting" else None
        if running is None or running.runs(self.job):
            return self.job
        applied = applied_job(self.config_map)  # read back only when the job's spec has drifted from the group's
        applied.spec.workers, applied.spec.ranks_per_pod = self.spec.workers, self.spec.ranks_per_pod
        return applied

    def _restart_when_ready(self) -> None:
        """The group is torn down after a failure or for a resize: start the next once every pod is gone and the
        backoff has passed."""
        self._delete(p for p in self.children if not p.terminating)
        if self.children:
            self.result.requeue_after = WAIT_SECONDS
            return
        restarting = condition(self.conditions, "Restarting") or {}
        since = timestamp(restarting.get("lastTransitionTime")) or self.now
        delay = 0.0 if restarting.get("reason") == "Resizing" else backoff_seconds(
            max(0, self.restarts - 1), self.settings.restart_backoff_seconds)
        left = delay - (self.now - since).total_seconds()
        if left > 0:
            self.result.requeue_after = left
            return
        running = self._next_group()
        self._start_group(running, "Restarted", f"starting {self.spec.workers} ranks again from "
                                                f"{self.status.get('checkpoint', {}).get('latest') or 'scratch'}")

    def _resize(self) -> str | None:
        """A running group's spec change: the new size to restart at, or None (other changes are refused)."""
        running = running_group(self.config_map)
        if running is None:
            return None
        changed = [] if running.runs(self.job) else changed_fields(applied_job(self.config_map), self.job)
        if changed:
            self.conditions = with_condition(
                self.conditions, "SpecChangeRefused", True, "RunningGroup",
                f"spec.{', spec.'.join(changed)} cannot change while the ranks run; the job keeps running as it "
                "was (suspend and resume it to apply the change)", self.now)
        else:
            self._clear("SpecChangeRefused", "SpecApplied", "the ranks run the job's spec")
        if running.workers != self.spec.workers:
            return f"resizing from {running.workers} to {self.spec.workers} ranks from the latest checkpoint"
        if running.ranks_per_pod != self.spec.ranks_per_pod:
            return (f"regrouping the {self.spec.workers} ranks from {running.ranks_per_pod} to "
                    f"{self.spec.ranks_per_pod} per pod from the latest checkpoint")
        return None

    def _follow_elastic_ranks(self) -> bool:
        """An elastic job's (recovery regroup) rank pods, rank 0's as any other: one that failed, was deleted or is
        gone is replaced alone (deleted if it failed, created again once gone) while the other ranks regroup without
        it and train on; a size changed by `kubectl scale` is followed in process, pods created (they join at a step
        boundary) or deleted (their ranks leave at one). The phase stays as it was. False when there is nothing to
        do, when the coordinator's pod is not running (it hosts the group's store and plans the regroups: its loss
        is the group's, _coordinator_lost), or when a failed rank cannot be replaced alone (_replaceable): the rules
        for the whole group decide then."""
        if self.coordinator is None or not self.coordinator.live:
            return False
        excess = [p for p in self.pods if p.index >= self.size]  # followed until gone
        kept = [p for p in self.pods if p.index < self.size]
        failed = [p for p in kept if p.phase == "Failed" and not p.terminating]
        if not all(map(self._replaceable, failed)):
            return False
        going = [p for p in kept if p.terminating]
        indices = {p.index for p in self.pods}
        missing = [index for index in range(self.size) if index not in indices]
        if not (excess or failed or going or missing):
            return False
        running = running_group(self.config_map)
        size_before = self.spec.pods - self.lent_before  # beyond it, a rank taken back: a joiner
        added = [index for index in missing if running is None or index >= min(running.workers, size_before)]
        replaced = sorted({p.index for p in failed + going} | (set(missing) - set(added)))
        leaving = [p.index for p in excess if p.live]
        under_way = [f"{self._ranks_named(indices)} {what}" for indices, what in (
            (replaced, "being replaced"), (added, "joining"), (leaving, "leaving")) if indices]
        message = f"{'; '.join(under_way)}; the other ranks train on (spec.elastic)" if under_way else None
        traded = self.loan.events  # a loan's ranks leaving or joining: its Events say so
        if message is not None and message != self.status.get("message"):  # once, not on every pass it takes
            for pod in failed:
                self.result.events.append(("Warning", "ReplacingRank", f"{self._pod_failure(pod, detail=True)}: "
                                           "replacing it alone; the other ranks regroup without it meanwhile "
                                           "(spec.elastic)"))
            if added and not traded:
                self.result.events.append(("Normal", "ScalingUp", f"{self.spec.workers} ranks wanted: "
                                           f"{self._ranks_named(added)} join at a step boundary (spec.elastic)"))
            if leaving and not traded:
                self.result.events.append(("Normal", "ScalingDown", f"{self.spec.workers} ranks wanted: "
                                           f"{self._ranks_named(leaving)} leave at a step boundary; the others "
                                           "train on (spec.elastic)"))
        if message is not None:
            self.status["message"] = message
        self._delete(p for p in excess if not p.terminating)
        self._delete(failed)
        if missing:
            running_job = self._next_group()
            self.result.create += [self._pod(running_job, index) for index in missing]
        self.result.requeue_after = WAIT_SECONDS
        return True

    @staticmethod
    def _replaceable(pod: RankPod) -> bool:
        """Whether a failed rank of an elastic job is replaced alone: not when it met a permanent failure (its
        replacement would meet it too, endlessly: the job fails, as without elastic), nor when it exited with
        GROUP_RESTART_EXIT_CODE (its group cannot regroup, the coordinator said: the whole group restarts)."""
        return pod.permanent_failure is None and pod.exit_code != GROUP_RESTART_EXIT_CODE

    def _coordinator_done(self) -> bool:
        """Whether an elastic job's coordinator exited 0 on its own (not deleted): the ranks marked the training
        finished, after the last step and the final checkpoint, and the last generation closed. The ranks still
        there are done, or replacements with nothing to join (deleted, as for any finished job)."""
        pod = self.coordinator
        return pod is not None and pod.phase == "Succeeded" and not pod.terminating

    def _coordinator_lost(self) -> str | None:
        """Why an elastic job's group lost its coordinator, if it did: failed (its fallback to a restart, planned,
        exits 1), deleted or evicted, or gone once the group ran. The ranks cannot regroup without its store: the
        whole group restarts, as for rank 0's loss without a coordinator. Gone before (an interrupted creation),
        _follow_pods creates it."""
        if not self.spec.regroups:
            return None
        pod = self.coordinator
        if pod is None:
            gone = coordinator_name(self.job.metadata.name)
            return f"the group's coordinator's pod {gone} is gone" if self.phase == "Running" else None
        if pod.phase == "Failed":
            return self._pod_failure(pod, detail=True)
        if pod.terminating:
            return f"the group's coordinator's pod {pod.name} was deleted or evicted"
        return None

    def _ranks_named(self, indices: list[int]) -> str:
        """The ranks of the pods `indices`, in words: `rank 1`, `rank 1, rank 3`."""
        return ", ".join(self._ranks(index) for index in indices)

    def _cause_on_its_way(self) -> bool:
        """Whether every failed pod only lost a peer, a pod still runs, and the first failure is recent: the cause
        (the peer) is about to report, and naming the effect would mislead."""
        failed = [p for p in self.pods if p.phase == "Failed"]
        if not failed or not all(p.lost_a_peer for p in failed):
            return False
        first = min(timestamp(p.finished_at) or self.now for p in failed)
        return any(p.live for p in self.pods) and (self.now - first).total_seconds() < PEER_WAIT_SECONDS

    def _failure(self) -> tuple[str, bool, PermanentFailureReport | None] | None:
        """Why the running group has failed, if it has, whether it hangs, and the report of a rank that met a
        permanent failure. Of several failed ranks the first to end is the cause: the others lost it (their
        collectives fail when it goes); of those that ended within the same second (finishedAt's resolution), one
        that lost a peer is not."""
        failed = sorted((p for p in self.pods if p.phase == "Failed"),
                        key=lambda p: (p.finished_at, p.lost_a_peer, p.index))
        if failed:
            pod = failed[0]  # a permanent failure: its report says what the log's tail would
            return self._pod_failure(pod, detail=pod.permanent_failure is None), False, pod.permanent_failure
        for pod in self.pods:
            if pod.terminating:
                return f"{self._ranks(pod.index)}'s pod {pod.name} was deleted or evicted", False, None
        indices = {p.index for p in self.pods}
        if self.phase == "Running":
            missing = sorted(set(range(self.size)) - indices)
            if missing:
                gone = pod_name(self.job.metadata.name, missing[0])
                return f"{self._ranks(missing[0])}'s pod {gone} is gone", False, None
            running_since = timestamp((condition(self.conditions, "Running") or {}).get("lastTransitionTime"))
            heartbeat = timestamp((self.status.get("progress") or {}).get("lastHeartbeat"))
            reports = self.spec.training_mode != "custom"  # a custom command reports nothing: no heartbeat to miss
            if reports and heartbeat_expired(heartbeat, running_since, self.spec.heartbeat_timeout_seconds, self.now):
                return f"rank 0 sent no heartbeat for more than {self.spec.heartbeat_timeout_seconds} s", True, None
        return None

    def _hosted(self, pod: RankPod) -> str:
        """What pod hosts, in words: `the group's coordinator`, or its ranks (`rank 1`, `ranks 2-3`)."""
        return "the group's coordinator" if pod is self.coordinator else self._ranks(pod.index)

    def _pod_failure(self, pod: RankPod, *, detail: bool) -> str:
        """A failed pod's cause: its rank(s) (or the coordinator), how they ended and, with `detail`, the end of its
        termination message."""
        said = f": {pod.termination_message}" if detail and pod.termination_message else ""
        if pod.failed_rank is not None:  # named by the pod's launcher
            rank, local_rank, how = pod.failed_rank
            return f"rank {rank} (pod {pod.name}, local rank {local_rank}) {how}{said}"
        hosted = self._hosted(pod)
        if pod.exit_code is None:  # it never exited: its node was lost, say (the pod's reason says so)
            return f"{hosted} (pod {pod.name}) failed{said}"
        return f"{hosted} (pod {pod.name}) exited with code {pod.exit_code}{said}"

    def _group_failed(self, cause: str, hung: bool, permanent: PermanentFailureReport | None) -> None:
        self.result.kill_at_once = hung
        decision = after_failure(restarts_done=self.restarts, backoff_limit=self.spec.backoff_limit,
                                 base_seconds=self.settings.restart_backoff_seconds, cause=cause,
                                 permanent=permanent)
        if decision.action == "fail":
            self._fail(decision.reason, decision.message)
            return
        self.restarts = decision.restarts
        if self.spec.elastic is not None:
            checkpoint = self.status.get("checkpoint") or {}
            self.status["lastRecovery"] = {
                "kind": "restart", "workers": self.spec.workers, "time": isoformat(self.now),
                "stoppedAtStep": (self.status.get("progress") or {}).get("step") or 0,
                "resumedAtStep": (checkpoint.get("step") or 0) if self._resume_from(self.job) else 0,
                "message": decision.message}
        self._tear_down("Restarting", decision.message, warning=True)

    def _tear_down(self, reason: str, message: str, warning: bool = False) -> None:
        self._delete(p for p in self.children if not p.terminating)
        self._set_phase("Restarting", reason, message, warning=warning)
        self.result.requeue_after = WAIT_SECONDS

    def _follow_pods(self) -> None:
        indices = {p.index for p in self.pods}
        missing = [index for index in range(self.size) if index not in indices]
        if missing or (self.spec.regroups and self.coordinator is None):
            # a group whose creation was interrupted (the operator restarted): finish it
            running = self._next_group()
            self.result.create += [self._pod(running, index) for index in missing]
            if self.coordinator is None:
                self.result.create += self._coordinator(running)
        coordinator_runs = not self.spec.regroups or (self.coordinator is not None
                                                      and self.coordinator.phase == "Running")
        if len(self.pods) == self.size and all(p.phase == "Succeeded" for p in self.pods):
            self._succeeded("every rank exited 0: training complete")
        elif (self.pods and not missing and coordinator_runs
              and all(p.phase in ("Running", "Succeeded") for p in self.pods)):
            self._restart_measured()
            self._set_phase("Running", "Running", f"{self.spec.workers} ranks running" + (
                f" in {self.spec.pods} pods" if self.spec.ranks_per_pod > 1 else ""))
            if self.loan.workers:
                self.status["message"] = (f"{self.size} of {self.spec.workers} ranks running; "
                                          f"{self.loan.workers} lent to InferencePool "
                                          f"{', '.join(self.loan.lent['to'])} (spec.elastic.lendTo)")
            self.result.requeue_after = WATCH_SECONDS
        elif self.spec.regroups and self.phase == "Running" and coordinator_runs:
            # An elastic job's replacement on its way: the group still trains (its coordinator runs) meanwhile.
            pending = next(p for p in self.pods if p.phase != "Running")
            self.status["message"] = (f"{self._ranks(pending.index)}'s replacement (pod {pending.name}) is "
                                      f"{pending.pending_reason or pending.phase}; the other ranks train on")
            self.result.requeue_after = WATCH_SECONDS
        else:
            pending = next((p for p in self.children if p.phase == "Pending"), None)
            if pending is None:
                message = "waiting for the rank pods to be created"
            else:
                detail = f": {pending.pending_message}" if pending.pending_message else ""
                message = f"{self._hosted(pending)} (pod {pending.name}): {pending.pending_reason}{detail}"
            self._set_phase("Pending", pending.pending_reason if pending else "Creating", message)
            self.result.requeue_after = WATCH_SECONDS

    # -- actions -----------------------------------------------------------------------------------------------

    def _start_group(self, job: ParallelTrainingJob, reason: str, message: str) -> None:
        self.result.create += group_objects(self.body, job)
        self.result.create += self._coordinator(job) + [self._pod(job, index) for index in range(self.size)]
        durable = job.spec.checkpoint.persistent_volume_claim is not None
        self.conditions = with_condition(
            self.conditions, "CheckpointsDurable", durable, "PersistentVolumeClaim" if durable else "EmptyDir",
            f"checkpoints on claim {job.spec.checkpoint.persistent_volume_claim}" if durable else
            "checkpoints are kept on an emptyDir: they do not survive a restart of the ranks; set "
            "spec.checkpoint.persistentVolumeClaim to keep them", self.now)
        # A first group is Pending already, but its creation is an Event of its own (once: a pass that tries the
        # creation again after an API failure finds startTime written).
        if self.phase == "Pending" and "startTime" not in self.status:
            self.result.events.append(("Normal", reason, message))
        self.status.setdefault("startTime", isoformat(self.now))
        self._set_phase("Pending", reason, message)
        self.result.requeue_after = WAIT_SECONDS

    def _pod(self, job: ParallelTrainingJob, index: int) -> dict[str, Any]:
        return self._placed(worker_pod(self.body, job, index, group=self.restarts,
                                       resume_from=self._resume_from(job), default_image=self.settings.worker_image,
                                       regroups_before=regroups_reported(self.status),
                                       world_size=self.size * self.spec.ranks_per_pod))

    def _coordinator(self, job: ParallelTrainingJob) -> list[dict[str, Any]]:
        """The group's coordinator pod, for an elastic job (recovery regroup); none otherwise."""
        if not job.spec.regroups:
            return []
        return [self._placed(coordinator_pod(self.body, job, group=self.restarts,
                                             default_image=self.settings.worker_image,
                                             world_size=self.size * self.spec.ranks_per_pod))]

    def _placed(self, pod: dict[str, Any]) -> dict[str, Any]:
        """A pod of the group where Kueue's admission puts the group (its flavours' nodes)."""
        return queueing.placed(pod, self.queued.placement) if self.queue is not None else pod

    def _ranks(self, index: int) -> str:
        """The ranks pod `index` hosts, in words: `rank 1`, or `ranks 2-3`."""
        per_pod = self.spec.ranks_per_pod
        first = index * per_pod
        return f"rank {first}" if per_pod == 1 else f"ranks {first}-{first + per_pod - 1}"

    def _resume_from(self, job: ParallelTrainingJob) -> str | None:
        """Where a group starts: the latest checkpoint rank 0 recorded; before any, with `checkpoint.resume`, the
        latest the claim holds (RESUME_LATEST: the ranks look); on an emptyDir always afresh (the previous group's
        checkpoints went with its pods)."""
        if job.spec.checkpoint.persistent_volume_claim is None:
            return None
        recorded = (self.status.get("checkpoint") or {}).get("latest")
        return recorded or (RESUME_LATEST if job.spec.checkpoint.resume else None)

    def _restart_measured(self) -> None:
        """An elastic job's restart is over once its new group runs: how long it took."""
        last = self.status.get("lastRecovery") or {}
        if last.get("kind") == "restart" and last.get("seconds") is None and self.phase != "Running":
            since = timestamp(last.get("time")) or self.now
            self.status["lastRecovery"] = {**last, "seconds": round((self.now - since).total_seconds(), 3)}

    def _succeeded(self, message: str) -> None:
        self._set_phase("Succeeded", "Succeeded", message)
        self.status["completionTime"] = isoformat(self.now)

    def _fail(self, reason: str, message: str) -> None:
        self._delete(p for p in self.live)
        self._set_phase("Failed", reason, message, warning=True)
        self.status["completionTime"] = isoformat(self.now)

    def _delete(self, pods) -> None:
        self.result.delete_pods += [p.name for p in pods if p.name not in self.result.delete_pods]

    def _set_phase(self, phase: str, reason: str, message: str, warning: bool = False) -> None:
        """The phase, its condition True (the other phases' False), and an Event when the phase changes."""
        if phase != self.phase:
            self.result.events.append(("Warning" if warning else "Normal", reason, message))
        for kind in TRAINING_PHASES:
            if kind == phase:
                self.conditions = with_condition(self.conditions, kind, True, reason, message, self.now)
            elif condition(self.conditions, kind) is not None:
                self.conditions = with_condition(self.conditions, kind, False, reason, message, self.now)
        self.phase = phase
        self.status["message"] = message

    def _clear(self, kind: str, reason: str, message: str) -> None:
        if (condition(self.conditions, kind) or {}).get("status") == "True":
            self.conditions = with_condition(self.conditions, kind, False, reason, message, self.now)

    def _finish(self) -> Plan:
        name = self.job.metadata.name
        master, address = group_master(self.job)
        ready_pods = sum(1 for p in self.pods if p.ready and p.phase == "Running")
        ready = ready_pods * self.spec.ranks_per_pod
        self.result.status = {
            "phase": self.phase,
            "conditions": self.conditions,
            "workers": {"ready": ready, "total": self.spec.workers, "summary": f"{ready}/{self.spec.workers}",
                        "readyPods": ready_pods, "pods": self.spec.pods},
            "master": {"pod": master, "address": address, "port": MASTER_PORT},
            "restarts": self.restarts,
            "recoveries": {"restarts": self.restarts},
            **({"lastRecovery": self.status["lastRecovery"]}
               if self.status.get("lastRecovery") != self.recovery_read else {}),
            "lent": self.loan.lent,
            "message": self.status.get("message", ""),
            "observedGeneration": self.body.get("metadata", {}).get("generation"),
            "selector": rank_selector_string(name),
            **{key: self.status[key] for key in ("startTime", "completionTime") if self.status.get(key)},
            **eta_removal(self.phase, self.status),
        }
        if self.queue_status is not None:
            self.result.status["queue"] = self.queue_status
            if self.admitted and self.result.workload_status is None:
                self.result.workload_status = queueing.pods_ready(self.queued.workload, self.phase == "Running",
                                                                  self.now)
        if self.loan.look_again is not None:  # a loan's window runs out: take back then, not at the next look
            self.result.requeue_after = min(self.result.requeue_after or self.loan.look_again, self.loan.look_again)
        left = seconds_left(timestamp(self.status.get("startTime")), self.spec.active_deadline_seconds, self.now)
        if left is not None and left > 0 and self.phase not in ("Succeeded", "Failed"):
            self.result.requeue_after = min(self.result.requeue_after or left, left)
        return self.result
