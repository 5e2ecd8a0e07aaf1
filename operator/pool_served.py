"""What the ready servers of an InferencePool report (their `/v2/models/{m}/ready` answers, asked by
pool_handlers.py), and what the pool's decision (pools.py) makes of it: the model they serve (status.model, and a
CheckpointsDiffer message while they serve different checkpoints), a promotion gate's Promoted and PromotionSkipped
Events, and the batching settings they run (status.batching, and which servers refused the pool's: each server reads
them from the pool itself, worker/serve/pool_watch.py, and reports a refusal in its readiness parameters)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tandem.api import InferencePool
from tandem.api.inference import BatchingSettings
from tandem.columns import file_name, four_figures
from tandem.contract import (
    REFUSED_BATCHING_PARAMETER,
    REFUSED_RETRY_SECONDS,
    SERVED_METRIC_PARAMETER,
    checkpoint_step,
)


@dataclass(frozen=True)
class Served:
    """What one ready server reports serving."""

    pod: str
    checkpoint: str | None
    source: str
    loaded_at: str
    batching: BatchingSettings | None = None
    """The batching settings it runs with (None: it does not say, so it is not counted)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the checkpoint's job recorded for it."""
    skipped: dict[str, Any] | None = None
    """With a promotion gate: the latest candidate it did not promote (status.lastSkipped's shape)."""
    refused: tuple[BatchingSettings, str] | None = None
    """The pool's batching settings it last refused (its model failed its warm-up at them), and its error."""


def refused_batching(parameters: dict[str, Any]) -> tuple[BatchingSettings, str] | None:
    """The batching settings a server reports refusing (`refused_<setting>` and `refused_reason` parameters), or
    None."""
    prefix = REFUSED_BATCHING_PARAMETER
    reason = parameters.get(f"{prefix}reason")
    if not isinstance(reason, str):
        return None
    try:
        settings = BatchingSettings.model_validate({name: parameters[f"{prefix}{name}"]
                                                   for name in BatchingSettings.model_fields})
    except (KeyError, ValueError):
        return None
    return settings, reason


def refused_settings(batching: BatchingSettings, served: list[Served]) -> dict[str, str]:
    """The ready servers that report refusing the pool's batching settings, with their error."""
    return {s.pod: s.refused[1] for s in sorted(served, key=lambda s: s.pod)
            if s.refused is not None and s.refused[0] == batching and s.batching != batching}


def batching_status(batching: BatchingSettings, served: list[Served],
                    refused: dict[str, str]) -> tuple[dict[str, Any] | None, str | None]:
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
        differ = "servers run other batching settings than the pool's, which they are taking from it: " + "; ".join(
            f"{s.pod}: {s.batching.summary()}" for s in others)
    if refused:
        differ = (f"{differ}. Refused (tried again after {REFUSED_RETRY_SECONDS:g} s; change the pool to try other "
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
