"""What a pod asks of its node: the sum over its containers of each resource's request (or its limit where the
request is absent, as the API server defaults it), plus the pod itself (`pods`). The scheduler of the emulated
cluster (devcluster) places pods by it; the operator weighs a trade of workers between a training job and an
InferencePool by it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity


def requests_of(pod: Mapping[str, Any]) -> dict[str, Decimal]:
    totals: dict[str, Decimal] = defaultdict(Decimal)
    for container in pod.get("spec", {}).get("containers") or []:
        resources = container.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        for name in {*requests, *limits}:
            totals[name] += parse_quantity(requests.get(name, limits.get(name)))
    totals["pods"] += 1
    return dict(totals)
