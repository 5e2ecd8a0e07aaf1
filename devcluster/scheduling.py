"""The nodes' capacity and the scheduler's verdicts, with the scheduler's own messages.

Every node (one by default; `Kubelet(nodes=N)`) has the same capacity and labels, besides its own
`kubernetes.io/hostname`. A pod fits on a node when, for each resource it asks for (the sum over its containers of
`requests`, or `limits` where a request is absent, as the API server defaults them), what is free on that node
(capacity less what the pods bound to it and not finished asked for) covers it; extended resources (`nvidia.com/gpu`)
the node lacks count as 0. A node that is not Ready (lost, see `Kubelet.lose`) or whose labels do not satisfy the
pod's nodeSelector does not take it either. The pod goes on the Ready node where it fits with the fewest pods bound
to it and not finished, ties to the first in order (`tandem-node`, `tandem-node-2`, ...): pods of equal requests
spread over the nodes as kube-scheduler's default scoring spreads them. A pod that fits nowhere stays Pending with
condition PodScheduled=False, reason Unschedulable and a message shaped like the scheduler's, each node's reason
counted over the nodes: `0/1 nodes are available: 1 Insufficient nvidia.com/gpu.`, `0/2 nodes are available:
1 Insufficient cpu, 1 node(s) were not ready.` A persistentVolumeClaim that does not exist is told for the pod as a
whole (`0/2 nodes are available: persistentvolumeclaim "data" not found.`, as kube-scheduler's PreFilter tells it),
once some node is Ready (while none is, the message counts the nodes not ready). GPUs are whole devices, numbered
per node: a pod is assigned device indices (its CUDA_VISIBLE_DEVICES).

Defaults are generous (64 CPUs, 256Gi, 0 GPUs) so that only a test that sets a capacity sees it bite.
Not emulated: init containers' requests, node affinity expressions, taints, priorities and preemption, and any
scoring but the spreading above.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

import aiohttp
from kubernetes.utils import parse_quantity

from tandem.pod_requests import requests_of

from .apiclient import Api, ApiError
from .writes import timestamp

logger = logging.getLogger(__name__)

GPU = "nvidia.com/gpu"
DEFAULT_CAPACITY = {"cpu": "64", "memory": "256Gi", "ephemeral-storage": "1Ti", "pods": "110", GPU: "0"}


class Node:
    def __init__(self, name: str, capacity: Mapping[str, Any] | None = None,
                 labels: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.capacity = {k: parse_quantity(v) for k, v in {**DEFAULT_CAPACITY, **(capacity or {})}.items()}
        self.labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})}
        self.allocated: dict[str, dict[str, Decimal]] = {}
        self.gpus: dict[str, list[int]] = {}
        # False while the node is lost (Kubelet.lose): nothing is bound to it, and its kubelet hears nothing
        self.ready = True

    def manifest(self) -> dict[str, Any]:
        """The Node object's status: capacity and allocatable (the same here), Ready."""
        quantities = {k: str(v) for k, v in self.capacity.items()}
        return {"capacity": quantities, "allocatable": quantities,
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                "message": "the test kubelet is posting ready status"}],
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                              {"type": "Hostname", "address": self.name}]}

    def free(self) -> dict[str, Decimal]:
        used: dict[str, Decimal] = defaultdict(Decimal)
        for requests in self.allocated.values():
            for name, amount in requests.items():
                used[name] += amount
        return {name: self.capacity.get(name, Decimal(0)) - used[name] for name in {*self.capacity, *used}}

    def unfit(self, pod: Mapping[str, Any]) -> list[str]:
        """The scheduler's reasons why the pod cannot go on this node (none when it fits)."""
        if not self.ready:
            return ["node(s) were not ready"]
        selector = pod.get("spec", {}).get("nodeSelector") or {}
        if any(self.labels.get(key) != value for key, value in selector.items()):
            return ["node(s) didn't match Pod's node affinity/selector"]
        free = self.free()
        short = sorted(name for name, amount in requests_of(pod).items() if amount > free.get(name, Decimal(0)))
        return [f"Insufficient {name}" if name != "pods" else "Too many pods" for name in short]

    def assign(self, uid: str, pod: Mapping[str, Any]) -> None:
        if uid in self.allocated:
            return
        requests = requests_of(pod)
        self.allocated[uid] = requests
        wanted = int(requests.get(GPU, 0))
        taken = {index for indices in self.gpus.values() for index in indices}
        self.gpus[uid] = [i for i in range(int(self.capacity.get(GPU, 0))) if i not in taken][:wanted]

    def release(self, uid: str) -> None:
        self.allocated.pop(uid, None)
        self.gpus.pop(uid, None)


def schedule(nodes: Sequence[Node], pod: Mapping[str, Any], missing_claims: list[str]) -> Node | str:
    """The node the pod goes on (see the module's docstring), or the scheduler's message when it fits on none: each
    reason counted over the nodes, the counted reasons sorted as kube-scheduler sorts them (as strings)."""
    if missing_claims and any(node.ready for node in nodes):
        return f'0/{len(nodes)} nodes are available: persistentvolumeclaim "{missing_claims[0]}" not found.'
    reasons: Counter[str] = Counter()
    fitting = []
    for node in nodes:
        unfit = node.unfit(pod)
        reasons.update(unfit)
        if not unfit:
            fitting.append(node)
    if fitting:
        return min(fitting, key=lambda node: len(node.allocated))
    return f"0/{len(nodes)} nodes are available: {', '.join(sorted(f'{n} {why}' for why, n in reasons.items()))}."


class Scheduler:
    """The default scheduler of the kubelet's nodes: binds the pending pods that fit (in arrival order), and tells
    those that do not why; pending pods are tried again on every change and every second."""

    def __init__(self, api: Api, nodes: Sequence[Node], pods: Mapping[str, dict[str, Any]]) -> None:
        self.api, self.nodes, self.pods = api, nodes, pods
        self.pending: dict[str, None] = {}  # uids, in arrival order
        self.kick = asyncio.Event()

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # pending pods are tried again every second
                await asyncio.wait_for(self.kick.wait(), timeout=1.0 if self.pending else None)
            self.kick.clear()
            for uid in list(self.pending):
                pod = self.pods.get(uid)
                if pod is None or pod["spec"].get("nodeName") or pod["metadata"].get("deletionTimestamp"):
                    self.pending.pop(uid, None)
                    continue
                try:
                    await self._try_to_bind(uid, pod)
                except (ApiError, aiohttp.ClientError) as error:
                    logger.warning("kubelet: scheduling %s: %s", pod["metadata"]["name"], error)

    async def _try_to_bind(self, uid: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        verdict = schedule(self.nodes, pod, await self._missing_claims(pod))
        if isinstance(verdict, str):
            scheduled = [c for c in pod.get("status", {}).get("conditions") or [] if c["type"] == "PodScheduled"]
            if not scheduled or scheduled[0].get("message") != verdict:
                await self.api.patch_status(path, {"phase": "Pending", "conditions": [{
                    "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": verdict,
                    "lastProbeTime": None, "lastTransitionTime": timestamp()}]})
            return
        node = verdict
        node.assign(uid, pod)
        try:
            await self.api.request("POST", f"{path}/binding", {
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node.name}})
        except ApiError:
            node.release(uid)  # deleted, or bound by someone else, meanwhile
        self.pending.pop(uid, None)

    async def _missing_claims(self, pod: dict[str, Any]) -> list[str]:
        namespace, missing = pod["metadata"]["namespace"], []
        for volume in pod.get("spec", {}).get("volumes") or []:
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if not claim:
                continue
            path = f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}"
            pvc = await self.api.get(path)
            if pvc is None:
                missing.append(claim)
            elif (pvc.get("status") or {}).get("phase") != "Bound":
                requests = ((pvc.get("spec") or {}).get("resources") or {}).get("requests") or {}
                await self.api.patch_status(path, {"phase": "Bound", "accessModes": pvc["spec"].get(
                    "accessModes", ["ReadWriteOnce"]), "capacity": {"storage": requests.get("storage", "1Gi")}})
        return missing
