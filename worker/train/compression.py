"""trainingMode sharedGradients: DL4J's SHARED_GRADIENTS (Strom-style threshold encoding) as a DDP comm hook,
with Deep Gradient Compression's corrections (Lin et al., ICLR 2018) on top.

Algorithm, per DDP gradient bucket and step, on every rank (the per-rank part is `accumulate` and `sparsify`,
pure functions):

1. With local gradient clipping, each parameter's gradient is scaled down to at most `local_gradient_clip` in
   L2 norm (DGC clips before accumulating, since the all-reduced gradient a global clip would see is never
   formed).
2. With momentum correction the rank keeps its own velocity, velocity = momentum * velocity + gain * gradient,
   and it is the velocity, not the raw gradient, that is accumulated; the optimizer then runs without momentum
   (modes.py), since the exchanged updates carry it. gain = (1 - momentum) / (1 - optimizer_momentum): a steady
   gradient g leaves the velocity at g / (1 - optimizer_momentum), as the optimizer's momentum buffer would.
   With momentum = optimizer_momentum (gain 1) this is DGC's momentum correction exactly; a shorter velocity
   (momentum 0.7 under an optimizer's 0.9, the API's default) measured better, since the residual already
   integrates: a long velocity on top keeps pushing entries long after they were sent. Without momentum
   correction the raw gradient is accumulated and the optimizer applies its momentum to the decoded mean
   (DL4J), so every sparse update echoes for 1 / (1 - momentum) steps after it arrives.
3. accumulated = residual + (velocity or gradient); the residual is this rank's error feedback.
4. At the first step, with a calibration, the threshold is set from the accumulated values before anything is
   encoded: each rank sends, once, the magnitude that the top max_sparsity of its bucket's entries reach (and
   with "perParameter" each parameter's own), and the threshold becomes their mean over ranks. Per parameter,
   each gets a fixed ratio (its mean over the threshold, at least parameter_floor): its entries are encoded
   against threshold * ratio from then on. A single threshold starves parameters whose gradients are small but
   matter, such as batch norm's scales and a classifier's biases; DGC selects per layer for the same reason.
   Without a calibration the threshold starts at initial_threshold and climbs (DL4J).
5. Every entry with |accumulated| >= its threshold tau is encoded as its sign (a ternary value -1/0/+1) and is
   worth sign * tau; it is subtracted from `accumulated`, and what is left becomes the new residual. With
   momentum factor masking the velocity of every entry this rank encoded is zeroed, so momentum built up before
   the send does not push the same entry again. Every `residual_clip_every` steps the residual is clipped to
   +-residual_clip_factor * tau (DL4J ResidualClippingPostProcessor).
6. The ranks all-gather their encoded counts (one int32 each). From these shared counts every rank takes the
   same decision: when the longest encoding exceeds 1/16 of the bucket, the bucket travels as a ternary bitmap
   (2 bits per element, DL4J's bitmap switch); otherwise as signed indices (int32, +(i+1) or -(i+1)), every
   rank's list padded to the longest one so a single all-gather carries them. No collective, no padding length
   and no branch that picks one depends on a rank-local value: a rank-local choice would deadlock the group.
   (The calibration's exchange, its values and the ratios are shared the same way.)
7. Every rank decodes all ranks' encodings into integer sums of signs (exact and order-independent, so the
   result is bit-identical on every rank and device) and hands DDP sum * tau / world_size: the mean of the
   decoded updates, as DDP's default all-reduce hands the mean gradient.
8. After the step's last bucket the threshold adapts, from the fraction of entries encoded over all ranks and
   buckets (again a shared value), toward the target band [min_sparsity, max_sparsity] (the ratios stay).
   Below the band it is multiplied by threshold_decay, as DL4J's AdaptiveThresholdAlgorithm does. Above it DL4J
   divides it by threshold_decay; here it grows by the overshoot, fraction / max_sparsity, at least by DL4J's
   step and at most by max_threshold_growth per step (max_threshold_growth = 1 / threshold_decay is DL4J's rule
   exactly). During a sparsity warm-up of `warmup_steps` the band starts `warmup_sparsity / max_sparsity` times
   higher and narrows geometrically to its target (DGC's exponential warm-up).

DL4J's algorithm is no momentum correction, no masking, no local clipping, no calibration, no warm-up and the
band 1e-4..1e-2: the hook's own defaults (Settings()), but for the faster climb (max_threshold_growth 2).

NaN/Inf: a rank whose bucket holds a NaN or Inf sends the count -1, and then every rank gets the bucket back
all NaN, as a dense all-reduce would spread it, so a NaN guard or an fp16 gradient scaler skips the step on
every rank; the bucket's residuals and velocities are left as they were. (With an fp16 gradient scaler the hook
sees scaled gradients: the threshold is in scaled units and re-adapts when the scale changes.)

Byte accounting, per rank (sum both counters over ranks to compare like with like):
- ``bytes_sent``: the payload this rank contributes to each collective: 4 bytes for its count, then 4 bytes per
  index of the padded list (4 * longest count) or ceil(n / 4) bytes for a bitmap of n elements; at the
  calibrated step 4 bytes per calibration value.
- ``dense_bytes``: what this rank would contribute to a dense all-reduce of the same buckets:
  element size (4 for fp32) * n.
Every rank sends the same bytes (the padded list or the bitmap), and every rank knows the encoded counts of all
ranks, so the threshold, the fraction of entries sent and the steps that went as bitmaps (`report`) are the same
on every rank: rank 0 reports them without a collective.

Residuals, velocities and ratios are kept per parameter, not per bucket: DDP rebuilds its buckets after the first
iteration, so a bucket index names different entries before and after. A parameter's key is the order in which
the hook first saw it (DDP's initial bucket layout, the same in every process that builds the model and its DDP
wrapper the same way), so ``state_dict()`` saved in one process loads into a fresh one.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, and rejects strings.
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "Encoded",
    "Settings",
    "ThresholdCompression",
    "adapt_threshold",
    "clip_parts_",
    "clip_residual_",
    "accumulate",
    "calibration_value",
    "calibration_values",
    "encode",
    "indices_to_sign_sums",
    "mask_momentum_",
    "pack_ternary",
    "payload_bytes",
    "signs_to_indices",
    "sparsify",
    "subtract_encoded_",
    "ternary_signs",
    "threshold_hook",
    "unpack_ternary",
    "uses_bitmap",
    "warmup_factor",
]

SPARSE_LIMIT_DIVISOR = 16
"""An encoding of more than numel / 16 entries (4 bytes each) travels as a 2-bit bitmap instead."""
BITMAP_ELEMENTS_PER_BYTE = 4
COUNT_BYTES = 4
INDEX_BYTES = 4
CALIBRATION_BYTES = 4
"""One calibration value (float32): a rank sends one per bucket, and one per parameter with per-parameter
calibration, once."""
CALIBRATIONS = ("off", "shared", "perParameter")
_SIGN_OF_CODE = torch.tensor([0, 1, 0, -1], dtype=torch.int8)
"""Bitmap code -> sign: 0 is zero, 1 is +tau, 3 (the low two bits of int8 -1) is -tau."""
_CODE_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


@dataclass(frozen=True)
class Settings:
    """What the hook does; the defaults are DL4J's algorithm with the faster threshold climb (modes.py maps
    spec.sharedGradients onto these)."""

    initial_threshold: float = 1e-3
    """The threshold of the first step (with a calibration, until one succeeds)."""
    min_sparsity: float = 1e-4
    max_sparsity: float = 1e-2
    threshold_decay: float = 0.965936
    residual_clip_factor: float = 5.0
    residual_clip_every: int = 5
    max_threshold_growth: float = 2.0
    momentum_correction: bool = False
    """Each rank accumulates its own velocity instead of the raw gradient (the optimizer must then run without
    momentum)."""
    optimizer_momentum: float = 0.0
    """The momentum the optimizer would have applied: a velocity fed gradient * gain with momentum `momentum`
    settles at gradient / (1 - optimizer_momentum), as the optimizer's momentum buffer would."""
    momentum: float | None = None
    """The velocity's own momentum; None: optimizer_momentum (DGC exactly)."""
    momentum_masking: bool = False
    """Zero the velocity of the entries a rank encoded (only with momentum correction)."""
    calibration: str = "off"
    """At the first step, set the threshold from the accumulated values themselves (`calibration_values`):
    "shared", one threshold for all entries, or "perParameter", besides it one fixed ratio per parameter."""
    parameter_floor: float = 0.01
    """Per-parameter calibration: no parameter's ratio below this (a bias before a batch norm has a gradient of
    almost nothing, which would otherwise set it a threshold of almost nothing)."""
    local_gradient_clip: float | None = None
    """Clip each parameter's gradient to this L2 norm on each rank before it is accumulated."""
    warmup_steps: int = 0
    warmup_sparsity: float = 1 / SPARSE_LIMIT_DIVISOR
    """The top of the target band at step 0 of a warm-up."""

    @property
    def velocity_momentum(self) -> float:
        return self.optimizer_momentum if self.momentum is None else self.momentum

    @property
    def velocity_gain(self) -> float:
        """What each gradient is multiplied by as it enters the velocity: (1 - momentum) / (1 - optimizer
        momentum), 1 for DGC's momentum correction exactly."""
        return (1 - self.velocity_momentum) / (1 - self.optimizer_momentum)

    def __post_init__(self) -> None:
        if not self.initial_threshold > 0:
            raise ValueError(f"initial_threshold must be positive, got {self.initial_threshold}")
        if not 0 < self.min_sparsity <= self.max_sparsity <= 1:
            raise ValueError(
                f"need 0 < min_sparsity <= max_sparsity <= 1, got {self.min_sparsity}, {self.max_sparsity}")
        if not 0 < self.threshold_decay < 1:
            raise ValueError(f"threshold_decay must be in (0, 1), got {self.threshold_decay}")
        if not self.residual_clip_factor > 0 or self.residual_clip_every < 1:
            raise ValueError(
                f"need residual_clip_factor > 0 and residual_clip_every >= 1, "
                f"got {self.residual_clip_factor}, {self.residual_clip_every}"
            )
        if not self.max_threshold_growth > 1:
            raise ValueError(f"max_threshold_growth must be above 1, got {self.max_threshold_growth}")
        for name in ("optimizer_momentum", "momentum"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if self.local_gradient_clip is not None and not self.local_gradient_clip > 0:
            raise ValueError(f"local_gradient_clip must be positive, got {self.local_gradient_clip}")
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {self.calibration!r}")
        if not 0 < self.parameter_floor <= 1:
            raise ValueError(f"parameter_floor must be in (0, 1], got {self.parameter_floor}")
        if self.warmup_steps < 0 or not 0 < self.warmup_sparsity <= 1:
            raise ValueError(
                f"need warmup_steps >= 0 and 0 < warmup_sparsity <= 1, got {self.warmup_steps}, "
                f"{self.warmup_sparsity}")


# --- the pieces ---------------------------------------------------------------------------------------------


Threshold = float | torch.Tensor
"""One threshold for every entry, or one per entry (per-parameter calibration)."""


def ternary_signs(values: torch.Tensor, threshold: Threshold) -> torch.Tensor:
    """int8 signs of the entries with |value| >= threshold, 0 elsewhere."""
    return torch.where(values.abs() >= threshold, values.sign(), 0).to(torch.int8)


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


def signs_to_indices(signs: torch.Tensor) -> torch.Tensor:
    """Signed 1-based int32 indices: +(i+1) for a +1 at i, -(i+1) for a -1 at i (0 is left free for padding)."""
    positions = signs.nonzero().squeeze(1)
    return ((positions + 1) * signs[positions]).to(torch.int32)


def indices_to_sign_sums(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Sum of the signs that `indices` (any number of ranks' lists, zero padding ignored) put on each entry."""
    sums = torch.zeros(numel, dtype=torch.int32, device=indices.device)
    # A padding 0 lands on entry 0 with sign 0, which adds nothing.
    return sums.index_add_(0, (indices.abs() - 1).clamp_(min=0), indices.sign())


def pack_ternary(signs: torch.Tensor) -> torch.Tensor:
    """A 2-bit-per-element bitmap (uint8, ceil(n / 4) bytes) of int8 signs."""
    codes = (signs & 3).to(torch.uint8)
    codes = torch.nn.functional.pad(codes, (0, -len(codes) % BITMAP_ELEMENTS_PER_BYTE))
    shifted = codes.view(-1, BITMAP_ELEMENTS_PER_BYTE) << _CODE_SHIFTS.to(codes.device)
    return shifted.sum(dim=1, dtype=torch.uint8)


def unpack_ternary(bitmap: torch.Tensor, numel: int) -> torch.Tensor:
    """int8 signs (shape [..., numel]) from bitmaps made by pack_ternary (shape [..., ceil(numel / 4)])."""
    codes = (bitmap.unsqueeze(-1) >> _CODE_SHIFTS.to(bitmap.device)) & 3
    codes = codes.flatten(-2)[..., :numel]
    return _SIGN_OF_CODE.to(bitmap.device)[codes.long()]


def uses_bitmap(counts: list[int], numel: int) -> bool:
    """The shared decision: the bucket goes as a bitmap when the longest encoding passes 1/16 of it."""
    return max(counts) * SPARSE_LIMIT_DIVISOR > numel


def payload_bytes(counts: list[int], numel: int) -> int:
    """What one rank sends for a bucket after its count: nothing when no rank encoded anything, else the bitmap
    or its index list padded to the longest."""
    longest = max(counts)
    if longest <= 0:
        return 0
    if uses_bitmap(counts, numel):
        return math.ceil(numel / BITMAP_ELEMENTS_PER_BYTE)
    return INDEX_BYTES * longest


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
    """Steps 1-3 of the module's algorithm: (residual + the clipped gradient or the new velocity, the new
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
    """Step 4 but residual clipping, in place on `accumulated` (it becomes the residual) and `velocity`."""
    signs = ternary_signs(accumulated, threshold)
    residual = subtract_encoded_(accumulated, signs, threshold)
    if velocity is not None and momentum_masking:
        mask_momentum_(velocity, signs)
    return Encoded(signs, residual, velocity)


def encode(
    gradient: torch.Tensor,
    residual: torch.Tensor,
    velocity: torch.Tensor | None,
    threshold: Threshold,
    *,
    sizes: list[int],
    momentum_correction: bool = False,
    momentum: float = 0.0,
    gain: float = 1.0,
    momentum_masking: bool = False,
    local_gradient_clip: float | None = None,
) -> Encoded:
    """The per-rank part of a step on one bucket (steps 1-4 of the module's algorithm but residual clipping), at
    `threshold`. `gradient`, `residual` and `velocity` are fp32 and left unchanged."""
    accumulated, velocity = accumulate(gradient, residual, velocity, sizes=sizes,
                                       momentum_correction=momentum_correction, momentum=momentum, gain=gain,
                                       local_gradient_clip=local_gradient_clip)
    return sparsify(accumulated, velocity, threshold, momentum_masking=momentum_masking)


# --- the hook's state ---------------------------------------------------------------------------------------


class ThresholdCompression:
    """The hook state: the threshold, each rank's residuals (and velocities), the counters. Register it with
    threshold_hook. Keyword arguments are Settings' fields."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, **settings) -> None:
        self.settings = Settings(**settings)
        self.process_group = process_group
        self.threshold = self.settings.initial_threshold
        self.calibrated = False
        """Whether a calibration has set the threshold (it does so once, at the first step it can)."""
        self.step = 0
        """Completed steps (hook rounds over all buckets)."""
        self.bytes_sent = 0
        self.dense_bytes = 0
        self.bitmap_exchanges = 0
        """Bucket exchanges that went as bitmaps (all ranks count the same)."""
        self.bitmap_steps = 0
        """Steps with at least one bucket exchanged as a bitmap."""
        self.encoded_entries = 0
        """Entries encoded, summed over ranks, buckets and steps (a shared value)."""
        self.offered_entries = 0
        """Entries that could have been encoded: bucket sizes x ranks, summed over buckets and steps."""
        self._residuals: dict[int, torch.Tensor] = {}
        self._velocities: dict[int, torch.Tensor] = {}
        self._ratios: dict[int, float] = {}
        """Per-parameter calibration: each parameter's threshold is threshold * its ratio (1 when absent)."""
        self._entry_ratios: dict[tuple, torch.Tensor] = {}
        self._parameter_keys: dict[int, int] = {}
        self._calibrating = False
        self._step_buckets = 0
        self._step_encoded = 0
        self._step_elements = 0
        self._step_bitmap = False

    def band(self) -> tuple[float, float]:
        """The target band in force for the step under way (raised during a warm-up)."""
        settings = self.settings
        factor = warmup_factor(self.step, warmup_steps=settings.warmup_steps,
                               warmup_sparsity=settings.warmup_sparsity, max_sparsity=settings.max_sparsity)
        return min(1.0, settings.min_sparsity * factor), min(1.0, settings.max_sparsity * factor)

    def report(self) -> dict[str, float | int]:
        """What status.communication shows of the compression (the same on every rank): the threshold, the
        fraction of gradient entries sent over all ranks and steps, and the steps that went as bitmaps."""
        fraction = self.encoded_entries / self.offered_entries if self.offered_entries else 0.0
        return {"threshold": self.threshold, "sent_fraction": fraction, "bitmap_steps": self.bitmap_steps}

    def state_dict(self) -> dict:
        """Threshold, step, counters and this rank's residuals and velocities (keyed by parameter),
        torch.load(weights_only)-safe."""
        return {
            "threshold": self.threshold,
            "calibrated": self.calibrated,
            "step": self.step,
            "bytes_sent": self.bytes_sent,
            "dense_bytes": self.dense_bytes,
            "bitmap_exchanges": self.bitmap_exchanges,
            "bitmap_steps": self.bitmap_steps,
            "encoded_entries": self.encoded_entries,
            "offered_entries": self.offered_entries,
            "ratios": dict(self._ratios),
            "residuals": {key: residual.detach().clone() for key, residual in self._residuals.items()},
            "velocities": {key: velocity.detach().clone() for key, velocity in self._velocities.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict(), before the DDP wrapper's first backward (residuals are matched to parameters
        by DDP's initial bucket layout); they move to each parameter's device when its bucket is reduced. A state
        saved before a counter existed starts that counter at 0."""
        self.threshold = float(state["threshold"])
        self.step = int(state["step"])
        self.calibrated = bool(state.get("calibrated", self.step > 0))
        self.bytes_sent = int(state["bytes_sent"])
        self.dense_bytes = int(state["dense_bytes"])
        self.bitmap_exchanges = int(state["bitmap_exchanges"])
        self.bitmap_steps = int(state.get("bitmap_steps", 0))
        self.encoded_entries = int(state.get("encoded_entries", 0))
        self.offered_entries = int(state.get("offered_entries", 0))
        self._residuals = {int(key): residual for key, residual in state["residuals"].items()}
        self._velocities = {int(key): velocity for key, velocity in state.get("velocities", {}).items()}
        self._ratios = {int(key): float(ratio) for key, ratio in state.get("ratios", {}).items()}
        self._entry_ratios = {}
        self._parameter_keys = {}

    def _gather(self, store: dict[int, torch.Tensor], keys: list[int], sizes: list[int],
                device: torch.device) -> torch.Tensor:
        parts = []
        for key, size in zip(keys, sizes, strict=True):
            kept = store.get(key)
            if kept is None:
                kept = torch.zeros(size, dtype=torch.float32, device=device)
            elif kept.numel() != size:
                raise ValueError(
                    f"the state kept for parameter #{key} has {kept.numel()} entries but the parameter has "
                    f"{size}: the compression state belongs to a different model"
                )
            parts.append(kept.to(device=device, dtype=torch.float32))
        return torch.cat(parts)

    def keys_of(self, parameters: list[torch.nn.Parameter]) -> tuple[list[int], list[int]]:
        """The keys (in the order the hook first saw each parameter) and sizes of a bucket's parameters."""
        keys = [self._parameter_keys.setdefault(id(parameter), len(self._parameter_keys)) for parameter in parameters]
        return keys, [parameter.numel() for parameter in parameters]

    def accumulate(self, gradient: torch.Tensor, keys: list[int],
                   sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's accumulated values for `gradient` (the concatenated gradients of the parameters `keys`),
        and the new velocity under momentum correction."""
        settings = self.settings
        residual = self._gather(self._residuals, keys, sizes, gradient.device)
        velocity = None
        if settings.momentum_correction:
            velocity = self._gather(self._velocities, keys, sizes, gradient.device)
        return accumulate(gradient.to(torch.float32), residual, velocity, sizes=sizes,
                          momentum_correction=settings.momentum_correction, momentum=settings.velocity_momentum,
                          gain=settings.velocity_gain, local_gradient_clip=settings.local_gradient_clip)

    def wants_calibration(self) -> bool:
        """Whether this bucket is calibrated before it is encoded: every bucket of a step, from the first step on
        until a calibration has succeeded (a shared decision: every rank has the same step, bucket order and
        flags, all set from shared values)."""
        return self.settings.calibration != "off" and (not self.calibrated or self._calibrating)

    def calibration_values(self, accumulated: torch.Tensor, sizes: list[int]) -> list[float]:
        """This rank's calibration values for the bucket, at the top of the band in force; NaN for a bucket that
        holds a NaN or Inf."""
        per_parameter = self.settings.calibration == "perParameter"
        if not bool(accumulated.isfinite().all()):
            return [math.nan] * (1 + (len(sizes) if per_parameter else 0))
        return calibration_values(accumulated, sizes, self.band()[1], per_parameter=per_parameter)

    def calibrate(self, values: list[list[float]], keys: list[int]) -> None:
        """From every rank's calibration values for a bucket (one row each): at the first calibration, the
        threshold becomes the mean of the ranks' bucket values; with per-parameter calibration each parameter's
        ratio becomes the mean of the ranks' values for it (at least parameter_floor times the bucket's) over
        the threshold. Nothing changes when a value is not finite (a NaN gradient: the next step tries again)."""
        if not all(math.isfinite(value) and value >= 0 for row in values for value in row):
            return
        means = [sum(column) / len(values) for column in zip(*values, strict=True)]
        if not means[0] > 0:
            return
        if not self.calibrated:
            self.threshold = means[0]
            self.calibrated = self._calibrating = True
        for key, mean in zip(keys, means[1:], strict=False):
            self._ratios[key] = max(mean, self.settings.parameter_floor * means[0]) / self.threshold
        self._entry_ratios = {}

    def thresholds(self, keys: list[int], sizes: list[int], device: torch.device) -> Threshold:
        """The threshold for each entry of a bucket: one float, or with per-parameter ratios one per entry."""
        if not any(key in self._ratios for key in keys):
            return self.threshold
        layout = (tuple(keys), device)
        ratios = self._entry_ratios.get(layout)
        if ratios is None:  # the ratios are fixed once calibrated: one vector per bucket layout
            per_parameter = torch.tensor([self._ratios.get(key, 1.0) for key in keys], dtype=torch.float32)
            ratios = per_parameter.repeat_interleave(torch.tensor(sizes)).to(device)
            self._entry_ratios[layout] = ratios
        return ratios * self.threshold

    def keep(self, encoded: Encoded, keys: list[int], sizes: list[int], threshold: Threshold | None = None) -> None:
        """Store an encoding's residual (clipped on a clipping step, against the threshold it was encoded at) and
        velocity, once the exchange goes ahead."""
        if (self.step + 1) % self.settings.residual_clip_every == 0:
            clip_residual_(encoded.residual, self.settings.residual_clip_factor,
                           self.threshold if threshold is None else threshold)
        self._residuals.update(zip(keys, encoded.residual.split(sizes), strict=True))
        if encoded.velocity is not None:
            self._velocities.update(zip(keys, encoded.velocity.split(sizes), strict=True))

    def count(self, counts: list[int], numel: int, element_size: int) -> None:
        """Book one bucket's exchange, from the counts every rank shares."""
        self._step_buckets += 1
        self.bytes_sent += COUNT_BYTES
        self.dense_bytes += element_size * numel
        self._step_elements += numel
        if min(counts) < 0:
            return
        self._step_encoded += sum(counts)
        self.encoded_entries += sum(counts)
        self.offered_entries += len(counts) * numel
        self.bytes_sent += payload_bytes(counts, numel)
        if max(counts) > 0 and uses_bitmap(counts, numel):
            self.bitmap_exchanges += 1
            self._step_bitmap = True

    def finish_step(self, world_size: int) -> None:
        """After the step's last bucket: adapt the threshold to the fraction encoded, over all ranks."""
        fraction = self._step_encoded / (world_size * self._step_elements)
        low, high = self.band()
        self.threshold = adapt_threshold(
            self.threshold,
            fraction,
            min_sparsity=low,
            max_sparsity=high,
            decay=self.settings.threshold_decay,
            max_growth=self.settings.max_threshold_growth,
        )
        self.step += 1
        self._calibrating = False
        self.bitmap_steps += self._step_bitmap
        self._step_buckets = self._step_encoded = self._step_elements = 0
        self._step_bitmap = False


def threshold_hook(state: ThresholdCompression, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: exchange the bucket threshold-encoded; resolves to the mean decoded update."""
    group = state.process_group
    world_size = dist.get_world_size(group)
    gradient = bucket.buffer()
    numel = gradient.numel()
    if numel >= torch.iinfo(torch.int32).max:
        raise ValueError(f"a bucket of {numel} elements is too large for int32 indices; lower bucket_cap_mb")
    keys, sizes = state.keys_of(bucket.parameters())
    accumulated, velocity = state.accumulate(gradient, keys, sizes)
    if state.wants_calibration():
        # At the first step only: the values at which each rank would encode the top of the band.
        mine = torch.tensor(state.calibration_values(accumulated, sizes), dtype=torch.float32, device=gradient.device)
        values = torch.empty(world_size * mine.numel(), dtype=torch.float32, device=gradient.device)
        dist.all_gather_single(values, mine, group=group)
        state.calibrate(values.view(world_size, -1).tolist(), keys)
        state.bytes_sent += CALIBRATION_BYTES * mine.numel()
    threshold = state.thresholds(keys, sizes, gradient.device)
    encoded = sparsify(accumulated, velocity, threshold, momentum_masking=state.settings.momentum_masking)
    signs = encoded.signs

    # A count of -1 tells every rank that this rank's gradient holds a NaN or Inf.
    count = torch.where(gradient.isfinite().all(), signs.count_nonzero(), -1).to(torch.int32).reshape(1)
    counts = torch.empty(world_size, dtype=torch.int32, device=gradient.device)
    dist.all_gather_single(counts, count, group=group)
    counts_list = counts.tolist()
    all_finite = min(counts_list) >= 0
    state.count(counts_list, numel, gradient.element_size())
    if all_finite:
        state.keep(encoded, keys, sizes, threshold)
    if bucket.is_last():
        state.finish_step(world_size)

    longest = max(counts_list)
    if not all_finite or longest == 0:
        # Like a dense all-reduce, a NaN/Inf on any rank reaches every rank (so a NaN guard or a gradient scaler
        # skips the step everywhere); the residuals and velocities stay as they were.
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(torch.full_like(gradient, 0.0 if all_finite else float("nan")))
        return done
    if uses_bitmap(counts_list, numel):
        payload = pack_ternary(signs)

        def sign_sums(gathered: torch.Tensor) -> torch.Tensor:
            return unpack_ternary(gathered.view(world_size, -1), numel).sum(dim=0, dtype=torch.int32)
    else:
        indices = signs_to_indices(signs)
        payload = torch.nn.functional.pad(indices, (0, longest - len(indices)))

        def sign_sums(gathered: torch.Tensor) -> torch.Tensor:
            return indices_to_sign_sums(gathered, numel)

    gathered = payload.new_empty(world_size * payload.numel())
    work = dist.all_gather_single(gathered, payload, group=group, async_op=True)
    scale = threshold / world_size

    def decode(future: torch.futures.Future) -> torch.Tensor:
        future.wait()
        return (sign_sums(gathered).to(torch.float32) * scale).to(gradient.dtype)

    return work.get_future().then(decode)
