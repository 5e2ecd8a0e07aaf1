"""The threshold: its calibration from the accumulated values at the first step (step 4 of the package's
algorithm), and its adaptation toward the target band after each step, with the sparsity warm-up (step 8)."""

import math

import torch

Threshold = float | torch.Tensor
"""One threshold for every entry, or one per entry (per-parameter calibration)."""

CALIBRATION_BYTES = 4
"""One calibration value (float32): a rank sends one per bucket, and one per parameter with per-parameter
calibration, once."""


def adapt_threshold(
    threshold: float,
    encoded_fraction: float,
    *,
    min_sparsity: float,
    max_sparsity: float,
    decay: float,
    max_growth: float,
) -> float:
    """The next threshold: lower (by decay) when too little was encoded; higher when too much, by the overshoot
    encoded_fraction / max_sparsity, at least 1 / decay and at most max_growth."""
    if encoded_fraction > max_sparsity:
        return threshold * min(max(encoded_fraction / max_sparsity, 1 / decay), max_growth)
    if encoded_fraction < min_sparsity:
        return threshold * decay
    return threshold


def warmup_factor(step: int, *, warmup_steps: int, warmup_sparsity: float, max_sparsity: float) -> float:
    """How many times the target band is raised at `step` (completed steps): warmup_sparsity / max_sparsity at
    step 0, falling geometrically to 1 at warmup_steps and after."""
    if step >= warmup_steps or warmup_sparsity <= max_sparsity:
        return 1.0
    return (warmup_sparsity / max_sparsity) ** (1 - step / warmup_steps)


def calibration_value(accumulated: torch.Tensor, fraction: float) -> float:
    """The threshold at which `fraction` of the entries of `accumulated` would be encoded: the k-th largest
    magnitude, k = ceil(fraction * n) (at least 1)."""
    k = min(accumulated.numel(), max(1, math.ceil(fraction * accumulated.numel())))
    return float(accumulated.abs().topk(k, sorted=False).values.min())


def calibration_values(accumulated: torch.Tensor, sizes: list[int], fraction: float, *,
                       per_parameter: bool) -> list[float]:
    """A rank's calibration values for a bucket: the bucket's, then with `per_parameter` each parameter's."""
    values = [calibration_value(accumulated, fraction)]
    if per_parameter:
        values += [calibration_value(part, fraction) for part in accumulated.split(sizes)]
    return values
