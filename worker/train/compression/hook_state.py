"""ThresholdCompression: what the sharedGradients hook keeps between buckets and steps (the threshold and its
calibration, each rank's residuals and velocities, the byte and entry counters) and checkpoints."""

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from tandem.worker.train.compression.accumulation import Encoded, accumulate, clip_residual_
from tandem.worker.train.compression.encoding import COUNT_BYTES, payload_bytes, uses_bitmap
from tandem.worker.train.compression.settings import Settings
from tandem.worker.train.compression.threshold import (
    Threshold,
    adapt_threshold,
    calibration_values,
    warmup_factor,
)


class ThresholdCompression:
    """The hook state: the threshold, each rank's residuals (and velocities), the counters. Register it with
    threshold_hook. Keyword arguments are Settings' fields."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, **settings) -> None:
        self.settings = Settings(**settings)
        self.process_group = process_group
        self.wait: Callable[[dist.Work], None] = dist.Work.wait
        """How the hook waits for its collectives (an elastic job's: abandoning them once a peer is lost)."""
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
