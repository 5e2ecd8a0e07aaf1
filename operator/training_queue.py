"""The queue and gang rules of a ParallelTrainingJob's decision (rule 4a of training.py), as a part of its reconciler:
whether the group may run (a job outside any queue may; a queued job while Kueue admits its Workload), the Workload
to create or replace, and what status.queue says. The pure functions over Workloads are queueing.py's.

`QueueRules` is mixed into training.py's reconciler and uses its state (`body`, `job`, `spec`, `children`, `status`,
`settings`, `queued`, `queue`, `queue_status`, `admitted`, `restarts`, `now`, `result`) and its actions (`_held`:
stop the group and wait in a phase; `_next_group`: the spec the next group runs)."""

from __future__ import annotations

from typing import Any

from tandem.operator import queueing
from tandem.operator.training_objects import selector, worker_pod


class QueueRules:
    def _may_run(self) -> bool:
        """Whether the group may run: a job outside any queue may; a queued job while Kueue admits its Workload.
        Otherwise the job is Queued (its ranks stopped, an evicted Workload's quota given back), or held Pending
        where the operator lacks what the spec asks for."""
        if self.spec.gang is not None and not self.settings.gang_scheduling:
            return self._held("Pending", "GangSchedulingDisabled",
                              "spec.gang asks for a PodGroup, but the operator runs without gang scheduling: start it "
                              "with --gang-scheduling (the chart's gangScheduling.enabled: true), or remove spec.gang")
        if self.queue is None:
            return True
        admission = self._admission()
        if not self.settings.kueue:
            return self._held("Queued", "KueueDisabled",
                              f"labelled for Kueue's queue {self.queue}, but the operator runs without Kueue: start it "
                              "with --kueue (the chart's kueue.enabled: true), or remove the label "
                              f"{queueing.QUEUE_LABEL}")
        existing = self.queued.workload
        if existing is None:
            if self.queued.priority_problem:
                return self._held("Queued", "PriorityClassNotFound", self.queued.priority_problem)
            self.result.create.append(self._workload())
            return self._held("Queued", "Queued", f"queued in {self.queue}: waiting for Kueue to admit it")
        name = existing["metadata"]["name"]
        if not queueing.same_pod_set(existing, self._workload()):
            if not self.children:
                self.result.delete_workload = name
            return self._held("Queued", "PodSetChanged",
                              f"the group changed ({self.spec.pods} pods): queued again in {self.queue}")
        if admission.admitted:
            self.admitted = True
            return True
        if admission.evicted and not self.children and admission.holds_quota:
            self.result.workload_status = queueing.released(existing, self.now)
            self.queue_status["evictions"] += 1
            self.result.events.append(("Normal", "Requeued", f"the ranks stopped; Kueue's quota given back, queued "
                                                             f"again in {self.queue}"))
        what = "evicted by Kueue" if admission.evicted else "waiting for Kueue"
        return self._held("Queued", admission.reason, f"{what} in {self.queue} ({admission.reason}): "
                                                      f"{admission.message}")

    def _admission(self) -> queueing.Admission:
        """The Workload's state, kept for status.queue."""
        admission = queueing.admission_of(self.queued.workload or {})
        previous = self.status.get("queue") or {}
        self.queue_status = {
            "name": self.queue, "workload": (self.queued.workload or {}).get("metadata", {}).get("name"),
            "admitted": admission.admitted, "reason": admission.reason, "message": admission.message,
            "evictions": int(previous.get("evictions") or 0),
            **({"clusterQueue": admission.cluster_queue} if admission.cluster_queue else {}),
            **({"priority": self.queued.workload["spec"]["priority"]}
               if "priority" in (self.queued.workload or {}).get("spec", {}) else {}),
        }
        return admission

    def queued_in(self) -> str:
        cluster_queue = (self.queue_status or {}).get("clusterQueue")
        return f"{self.queue}" + (f" (ClusterQueue {cluster_queue})" if cluster_queue else "")

    def _workload(self) -> dict[str, Any]:
        """The Workload the next group needs (its pods as they are before an admission places them)."""
        job = self._next_group()
        template = worker_pod(self.body, job, 0, group=self.restarts, resume_from=None,
                              default_image=self.settings.worker_image)
        return queueing.workload(self.body, job, template, self.queued.priority, selector(job.metadata.name))
