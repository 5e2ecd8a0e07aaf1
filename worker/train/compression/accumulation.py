"""What each rank accumulates and keeps (steps 1-3 and 5 of the package's algorithm): local gradient clipping,
momentum correction, the error-feedback residual, and momentum factor masking once a bucket is encoded."""

from typing import NamedTuple

import torch

from tandem.worker.train.compression.encoding import ternary_signs
from tandem.worker.train.compression.threshold import Threshold


def subtract_encoded_(accumulated: torch.Tensor, signs: torch.Tensor, threshold: Threshold) -> torch.Tensor:
    """Error feedback, in place: remove sign * threshold from every encoded entry; returns the residual."""
    if torch.is_tensor(threshold):
        return accumulated.sub_(signs.to(accumulated.dtype) * threshold)
    return accumulated.sub_(signs.to(accumulated.dtype), alpha=threshold)


def clip_residual_(residual: torch.Tensor, factor: float, threshold: Threshold) -> torch.Tensor:
    """DL4J ResidualClippingPostProcessor, in place: clip the residual to +-factor * threshold."""
    limit = factor * threshold
    return residual.clamp_(min=-limit, max=limit)


def clip_parts_(values: torch.Tensor, sizes: list[int], max_norm: float) -> torch.Tensor:
    """Local gradient clipping, in place: scale each consecutive part (one parameter's entries) of `values` down
    to at most `max_norm` in L2 norm; parts within it are left exactly as they are."""
    for part in values.split(sizes):
        norm = float(torch.linalg.vector_norm(part))
        if norm > max_norm:
            part.mul_(max_norm / norm)
    return values


def mask_momentum_(velocity: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Momentum factor masking, in place: zero the velocity of every encoded entry."""
    return velocity.masked_fill_(signs != 0, 0.0)


class Encoded(NamedTuple):
    """One rank's encoding of a bucket, and the state it leaves if the exchange goes ahead."""

    signs: torch.Tensor
    residual: torch.Tensor
    velocity: torch.Tensor | None


def accumulate(
    gradient: torch.Tensor,
    residual: torch.Tensor,
    velocity: torch.Tensor | None,
    *,
    sizes: list[int],
    momentum_correction: bool = False,
    momentum: float = 0.0,
    gain: float = 1.0,
    local_gradient_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps 1-3 of the package's algorithm: (residual + the clipped gradient or the new velocity, the new
    velocity). With momentum correction the velocity is momentum * velocity + gain * gradient. The arguments are
    fp32 and left unchanged."""
    update = gradient
    if local_gradient_clip is not None:
        update = clip_parts_(gradient.clone(), sizes, local_gradient_clip)
    if momentum_correction:
        if velocity is None:
            raise ValueError("momentum correction needs a velocity")
        velocity = velocity.mul(momentum).add_(update, alpha=gain)
        update = velocity
    return residual + update, velocity if momentum_correction else None


def sparsify(accumulated: torch.Tensor, velocity: torch.Tensor | None, threshold: Threshold, *,
             momentum_masking: bool = False) -> Encoded:
    """Step 5 but residual clipping, in place on `accumulated` (it becomes the residual) and `velocity`."""
    signs = ternary_signs(accumulated, threshold)
    residual = subtract_encoded_(accumulated, signs, threshold)
    if velocity is not None and momentum_masking:
        mask_momentum_(velocity, signs)
    return Encoded(signs, residual, velocity)

