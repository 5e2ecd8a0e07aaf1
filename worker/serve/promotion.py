"""The promotion gate of a pool following a training job (`fromTrainingJob.promote`): whether a new checkpoint
beats the served one by the job's own measure, and which checkpoint a server starts on. Pure functions; the server
(served_model.py) applies them, the operator reports what the servers did (operator/pools.py).

The metric is the one the trainer recorded for each checkpoint in its manifest (`metrics`, rank 0's evaluation on
evalData when it wrote the checkpoint), never one the server measures itself: the server has no labelled data, and
every replica must decide alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tandem.api.inference import Promotion


@dataclass(frozen=True)
class Verdict:
    promote: bool
    reason: str
    """Why, in words naming the values compared: for the log line and the pool's status.lastSkipped."""
    metric: float | None
    """The candidate's value of the gate's metric (None: it has none recorded)."""


def recorded_metrics(manifest: dict[str, Any]) -> dict[str, float]:
    """A checkpoint manifest's `metrics`, the finite numbers only (a checkpoint written before metrics were recorded,
    or without evalData, has none)."""
    metrics = manifest.get("metrics")
    if not isinstance(metrics, dict):
        return {}
    return {str(name): float(value) for name, value in metrics.items()
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)}


def better(promotion: Promotion, candidate: float, served: float) -> bool:
    """Whether `candidate` beats `served` by more than minDelta in the gate's direction (equal never does)."""
    gain = candidate - served if promotion.mode == "max" else served - candidate
    return gain > promotion.min_delta


def judge(promotion: Promotion, candidate: dict[str, float], served: dict[str, float]) -> Verdict:
    """Whether to swap from the served checkpoint (its recorded `served` metrics) to a candidate (`candidate`)."""
    name = promotion.metric
    value = candidate.get(name)
    if value is None:
        recorded = ", ".join(sorted(candidate)) or "none"
        return Verdict(False, f"it has no recorded {name} (its metrics: {recorded}; does the job set evalData?)", None)
    current = served.get(name)
    if current is None:
        return Verdict(True, f"{name} {value:.6g}, and the served checkpoint has none recorded", value)
    direction = "above" if promotion.mode == "max" else "below"
    margin = f" by more than {promotion.min_delta:g}" if promotion.min_delta else ""
    if better(promotion, value, current):
        return Verdict(True, f"{name} {value:.6g} is {direction} the served {current:.6g}{margin}", value)
    return Verdict(False, f"{name} {value:.6g} is not {direction} the served {current:.6g}{margin}", value)


def best(promotion: Promotion, candidates: Iterable[tuple[str, dict[str, float]]]) -> str | None:
    """The checkpoint a gated server starts on: of (name, metrics) oldest first, the best by the metric (the newest
    of equals); None when none has the metric recorded (the server then starts on the latest)."""
    chosen: tuple[str, float] | None = None
    for name, metrics in candidates:
        value = metrics.get(promotion.metric)
        if value is not None and (chosen is None or _at_least(promotion, value, chosen[1])):
            chosen = (name, value)
    return chosen[0] if chosen else None


def _at_least(promotion: Promotion, value: float, other: float) -> bool:
    return value >= other if promotion.mode == "max" else value <= other
