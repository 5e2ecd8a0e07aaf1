"""What the ready servers of an InferencePool report (their `/v2/models/{m}/ready` answers, asked by
pool_handlers.py), and what the pool's decision (pools.py) makes of it: the model they serve (status.model, and a
CheckpointsDiffer message while they serve different checkpoints), a promotion gate's Promoted and PromotionSkipped
Events, and the batching settings they run (status.batching, which servers to send the pool's settings to, and
which refused them lately)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tandem.api import InferencePool
from tandem.api.inference import BatchingSettings
from tandem.columns import file_name, four_figures
from tandem.contract import SERVED_METRIC_PARAMETER, checkpoint_step

REFUSED_PUSH_SECONDS = 30.0
"""How long a server that refused the pool's batching settings (say its model fails at the new batch size) is left
alone before they are sent again: each try costs it a warm-up."""


@dataclass(frozen=True)
class Served:
    """What one ready server reports serving."""

    pod: str
    checkpoint: str | None
    source: str
    loaded_at: str
    batching: BatchingSettings | None = None
    """The batching settings it runs with (None: it does not say, so it is neither counted nor pushed to)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the checkpoint's job recorded for it."""
    skipped: dict[str, Any] | None = None
    """With a promotion gate: the latest candidate it did not promote (status.lastSkipped's shape)."""


@dataclass(frozen=True)
class Refusal:
    """A server's answer refusing the batching settings it was sent."""

    settings: dict[str, Any]
    message: str
    at: datetime


def batching_pushes(batching: BatchingSettings, served: list[Served],
                    refused: dict[str, str] | None = None) -> list[str]:
    """The ready servers to send the pool's `batching` to: those that report running other settings, less those that
    refused them lately (`refused`: by pod)."""
    return sorted(s.pod for s in served if s.batching is not None and s.batching != batching
                  and s.pod not in (refused or {}))


def refused_settings(batching: BatchingSettings, served: list[Served], refusals: dict[str, Refusal],
                     now: datetime) -> dict[str, str]:
    """The ready servers that refused the pool's batching settings within REFUSED_PUSH_SECONDS, with their answer."""
    wanted = batching.to_dict()
    pods = {s.pod for s in served}
    return {pod: refusal.message for pod, refusal in sorted(refusals.items()) if pod in pods
            and refusal.settings == wanted and (now - refusal.at).total_seconds() < REFUSED_PUSH_SECONDS}


def batching_status(batching: BatchingSettings, served: list[Served], refused: dict[str, str],
                    live: bool) -> tuple[dict[str, Any] | None, str | None]:
    """What the ready servers run (the settings most of them report), and a message while some run other settings
    than the pool's (naming those that refused them, with their answer)."""
    reported = [s for s in served if s.batching is not None]
    if not reported:
        return None, None
    counts = Counter(s.batching.model_dump_json() for s in reported)
    running = BatchingSettings.model_validate_json(counts.most_common(1)[0][0]).to_dict()
    others = [s for s in sorted(reported, key=lambda s: s.pod) if s.batching != batching]
    differ = None
    if others:
        how = "which are being pushed to them" if live else \
            "until the rolling update replaces them (a pool with a token rolls its servers for a batching change)"
        differ = f"servers run other batching settings than the pool's, {how}: " + "; ".join(
            f"{s.pod}: {s.batching.summary()}" for s in others)
    if refused:
        differ = (f"{differ}. Refused (sent again after {REFUSED_PUSH_SECONDS:g} s; change the pool to try other "
                  "settings): " + "; ".join(f"{pod}: {message}" for pod, message in refused.items()))
    return running, differ


def model_status(pool: InferencePool, served: list[Served]) -> tuple[dict[str, Any] | None, str | None]:
    """The pool's model from what the ready servers report, and a message when they serve different checkpoints."""
    if not served:
        return None, None
    counts = Counter(s.checkpoint for s in served)
    checkpoint = counts.most_common(1)[0][0]
    same = [s for s in served if s.checkpoint == checkpoint]
    model = {"source": same[0].source, "loadedAt": max(s.loaded_at for s in same)}
    if checkpoint is not None:
        model["checkpoint"], model["checkpointFile"] = checkpoint, file_name(checkpoint)
    if same[0].metrics:
        model["metrics"] = dict(same[0].metrics)
    source = pool.spec.model.from_training_job
    if source is not None and source.promote is not None and source.promote.metric in same[0].metrics:
        model["gateMetric"] = f"{source.promote.metric}={four_figures(same[0].metrics[source.promote.metric])}"
    differ = None
    if len(counts) > 1:
        differ = "replicas serve different checkpoints: " + "; ".join(
            f"{s.pod}: {s.checkpoint}" for s in sorted(served, key=lambda s: s.pod))
    return model, differ


def served_metrics(parameters: dict[str, Any]) -> dict[str, float]:
    """The recorded metrics a server's model metadata reports (`metric.<name>` parameters; numbers only)."""
    prefix = SERVED_METRIC_PARAMETER
    return {key[len(prefix):]: float(value) for key, value in parameters.items()
            if key.startswith(prefix) and len(key) > len(prefix) and isinstance(value, int | float)
            and not isinstance(value, bool) and math.isfinite(value)}


def skipped_candidate(parameters: dict[str, Any]) -> dict[str, Any] | None:
    """The candidate a gated server last skipped, as status.lastSkipped holds it; None when it reports none."""
    checkpoint, reason = parameters.get("skipped_checkpoint"), parameters.get("skipped_reason")
    if not isinstance(checkpoint, str) or not checkpoint:
        return None
    skipped: dict[str, Any] = {"checkpoint": checkpoint, "reason": str(reason or "")}
    metric = parameters.get("skipped_metric")
    if isinstance(metric, int | float) and not isinstance(metric, bool) and math.isfinite(metric):
        skipped["metric"] = float(metric)
    return skipped


def latest_skipped(served: list[Served]) -> dict[str, Any] | None:
    """The latest candidate a gated server skipped (the highest step, as the servers report them)."""
    skipped = [s.skipped for s in served if s.skipped is not None]
    return max(skipped, key=lambda s: (checkpoint_step(s["checkpoint"].rsplit("/", 1)[-1]) or -1, s["checkpoint"]),
               default=None)


def promotion_events(status: dict[str, Any], model: dict[str, Any] | None,
                     last_skipped: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """A gated pool's Events, from its status before this pass and what the servers report now: Promoted when the
    pool's served checkpoint (status.model, the one most ready replicas serve) changed, PromotionSkipped for a newly
    skipped one."""
    events = []
    before = (status.get("model") or {}).get("checkpoint")
    now = (model or {}).get("checkpoint")
    if before is not None and now is not None and now != before:
        metrics = ", ".join(f"{name} {value:.6g}" for name, value in sorted((model.get("metrics") or {}).items()))
        events.append(("Normal", "Promoted", f"serving {now}" + (f" ({metrics})" if metrics else "") +
                       f" in place of {before}"))
    skipped_before = (status.get("lastSkipped") or {}).get("checkpoint")
    if last_skipped is not None and last_skipped["checkpoint"] != skipped_before:
        events.append(("Warning", "PromotionSkipped", f"not serving {last_skipped['checkpoint']}: "
                       f"{last_skipped['reason']}"))
    return events
