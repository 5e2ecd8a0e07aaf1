"""The operator's pool metrics: what a pass's status and Events count as a swap or a refusal (pure), and the series
one pool's passes leave in prometheus_client's registry."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from tandem.operator import metrics

SERVING_100 = {"model": {"checkpoint": "/m/step-00000100.pt"}, "readyReplicas": 2}
SERVING_200 = {"model": {"checkpoint": "/m/step-00000200.pt"}, "readyReplicas": 2}
REFUSED = {"conditions": [{"type": "BatchingDiffers", "status": "True", "reason": "Refused"}]}
CHANGING = {"conditions": [{"type": "BatchingDiffers", "status": "True", "reason": "Changing"}]}
SKIPPED = [("Warning", "PromotionSkipped", "not serving step-00000300.pt: accuracy 0.5 < 0.9")]

# (name, before, after, events, expected (swapped, refused))
CASES = [
    ("nothing served yet, then a checkpoint: not a swap", {}, SERVING_100, [], (False, [])),
    ("the same checkpoint again: not a swap", SERVING_100, SERVING_100, [], (False, [])),
    ("a newer checkpoint served: a swap", SERVING_100, SERVING_200, [], (True, [])),
    ("the servers stop reporting: not a swap", SERVING_100, {}, [], (False, [])),
    ("the gate skipped a candidate: a promotion refusal", SERVING_100, SERVING_100, SKIPPED, (False, ["promotion"])),
    ("the servers refuse batching settings: counted once", CHANGING, REFUSED, [], (False, ["batching"])),
    ("still refused on the next pass: not counted again", REFUSED, REFUSED, [], (False, [])),
]


@pytest.mark.parametrize(("name", "before", "after", "events", "expected"), CASES, ids=[c[0] for c in CASES])
def test_pool_changes(name, before, after, events, expected):
    assert metrics.pool_changes(before, after, events) == expected


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_a_pools_passes_set_its_series_and_its_removal_takes_them_away():
    key = ("ml", "metrics-pool")
    labels = {"namespace": "ml", "pool": "metrics-pool"}
    phases = metrics.PhaseCount(metrics.POOLS_BY_PHASE, ("Loading", "Ready"))
    phases.set(key, "Ready")
    metrics.observe_pool(key, SERVING_100, SERVING_200, 3, SKIPPED)
    metrics.observe_pool(key, SERVING_200, {**SERVING_200, **REFUSED}, 3, [])
    assert sample("tandem_operator_pools", phase="Ready") == 1
    assert sample("tandem_operator_pool_ready_replicas", **labels) == 2
    assert sample("tandem_operator_pool_replicas", **labels) == 3
    assert sample("tandem_operator_pool_swaps_total", **labels) == 1
    assert sample("tandem_operator_pool_refusals_total", **labels, what="promotion") == 1
    assert sample("tandem_operator_pool_refusals_total", **labels, what="batching") == 1
    phases.set(key, None)
    metrics.forget_pool(key)
    assert sample("tandem_operator_pools", phase="Ready") == 0
    assert sample("tandem_operator_pool_ready_replicas", **labels) is None
    assert sample("tandem_operator_pool_swaps_total", **labels) is None
