"""trainingMode sharedGradients: DL4J's SHARED_GRADIENTS (Strom-style threshold encoding) as a DDP comm hook.

Algorithm, per DDP gradient bucket and step, on every rank:

1. accumulated = residual + gradient (the residual is this rank's error feedback, kept between steps).
2. Every entry with |accumulated| >= tau is encoded as its sign (a ternary value -1/0/+1) and is worth
   sign * tau; it is subtracted from `accumulated`, and what is left becomes the new residual. Every
   `residual_clip_every` steps the residual is clipped to +-residual_clip_factor * tau (DL4J
   ResidualClippingPostProcessor).
3. The ranks all-gather their encoded counts (one int32 each). From these shared counts every rank takes the
   same decision: when the longest encoding exceeds 1/16 of the bucket, the bucket travels as a ternary bitmap
   (2 bits per element, DL4J's bitmap switch); otherwise as signed indices (int32, +(i+1) or -(i+1)), every
   rank's list padded to the longest one so a single all-gather carries them. No collective, no padding length
   and no branch that picks one depends on a rank-local value: a rank-local choice would deadlock the group.
4. Every rank decodes all ranks' encodings into integer sums of signs (exact and order-independent, so the
   result is bit-identical on every rank and device) and hands DDP sum * tau / world_size: the mean of the
   decoded updates, as DDP's default all-reduce hands the mean gradient.
5. After the step's last bucket the threshold adapts, from the fraction of entries encoded over all ranks and
   buckets (again a shared value). Below min_sparsity it is multiplied by threshold_decay, as DL4J's
   AdaptiveThresholdAlgorithm does. Above max_sparsity DL4J divides it by threshold_decay; here it grows by the
   overshoot, fraction / max_sparsity, at least by DL4J's step and at most by max_threshold_growth per step
   (max_threshold_growth = 1 / threshold_decay is DL4J's rule exactly).

NaN/Inf: a rank whose bucket holds a NaN or Inf sends the count -1, and then every rank gets the bucket back
all NaN, as a dense all-reduce would spread it, so a NaN guard or an fp16 gradient scaler skips the step on
every rank; the bucket's residuals are left as they were. (With an fp16 gradient scaler the hook sees scaled
gradients: the threshold is in scaled units and re-adapts when the scale changes.)

Why the faster climb: from DL4J's initial 1e-3, DL4J's step (0.5 per 20 steps) needs about 100 steps to reach
where a small model's gradients are, and until then nearly every entry is encoded and goes as a bitmap. On the
digits MLP (2 ranks, 30 epochs) that early phase alone costs about 1% of the dense bytes: 1.4% in all with
DL4J's rule against 0.3% with the default growth cap of 2, at the same eval accuracy (bench/RESULTS.md). With
either rule the threshold settles near mean |gradient| / max_sparsity, each entry is sent about once per
1 / max_sparsity steps, and the first epochs converge more slowly than with a dense all-reduce.

Byte accounting, per rank (sum both counters over ranks to compare like with like):
- ``bytes_sent``: the payload this rank contributes to each collective: 4 bytes for its count, then 4 bytes per
  index of the padded list (4 * longest count) or ceil(n / 4) bytes for a bitmap of n elements.
- ``dense_bytes``: what this rank would contribute to a dense all-reduce of the same buckets:
  element size (4 for fp32) * n.

Residuals are kept per parameter, not per bucket: DDP rebuilds its buckets after the first iteration, so a
bucket index names different entries before and after. A parameter's key is the order in which the hook first
saw it (DDP's initial bucket layout, the same in every process that builds the model and its DDP wrapper the
same way), so ``state_dict()`` saved in one process loads into a fresh one.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, and rejects strings.
import torch
import torch.distributed as dist

__all__ = [
    "ThresholdCompression",
    "adapt_threshold",
    "clip_residual_",
    "indices_to_sign_sums",
    "pack_ternary",
    "signs_to_indices",
    "subtract_encoded_",
    "ternary_signs",
    "threshold_hook",
    "unpack_ternary",
]

SPARSE_LIMIT_DIVISOR = 16
"""An encoding of more than numel / 16 entries (4 bytes each) travels as a 2-bit bitmap instead."""
BITMAP_ELEMENTS_PER_BYTE = 4
COUNT_BYTES = 4
_SIGN_OF_CODE = torch.tensor([0, 1, 0, -1], dtype=torch.int8)
"""Bitmap code -> sign: 0 is zero, 1 is +tau, 3 (the low two bits of int8 -1) is -tau."""
_CODE_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def ternary_signs(values: torch.Tensor, threshold: float) -> torch.Tensor:
    """int8 signs of the entries with |value| >= threshold, 0 elsewhere."""
    return torch.where(values.abs() >= threshold, values.sign(), 0).to(torch.int8)


def subtract_encoded_(accumulated: torch.Tensor, signs: torch.Tensor, threshold: float) -> torch.Tensor:
    """Error feedback, in place: remove sign * threshold from every encoded entry; returns the residual."""
    return accumulated.sub_(signs.to(accumulated.dtype), alpha=threshold)


def clip_residual_(residual: torch.Tensor, factor: float, threshold: float) -> torch.Tensor:
    """DL4J ResidualClippingPostProcessor, in place: clip the residual to +-factor * threshold."""
    limit = factor * threshold
    return residual.clamp_(-limit, limit)


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


class ThresholdCompression:
    """The hook state: the threshold, each rank's residuals, the byte counters. Register it with threshold_hook."""

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        initial_threshold: float = 1e-3,
        min_sparsity: float = 1e-4,
        max_sparsity: float = 1e-2,
        threshold_decay: float = 0.965936,
        residual_clip_factor: float = 5.0,
        residual_clip_every: int = 5,
        max_threshold_growth: float = 2.0,
    ) -> None:
        if not initial_threshold > 0:
            raise ValueError(f"initial_threshold must be positive, got {initial_threshold}")
        if not 0 < min_sparsity <= max_sparsity <= 1:
            raise ValueError(f"need 0 < min_sparsity <= max_sparsity <= 1, got {min_sparsity}, {max_sparsity}")
        if not 0 < threshold_decay < 1:
            raise ValueError(f"threshold_decay must be in (0, 1), got {threshold_decay}")
        if not residual_clip_factor > 0 or residual_clip_every < 1:
            raise ValueError(
                f"need residual_clip_factor > 0 and residual_clip_every >= 1, "
                f"got {residual_clip_factor}, {residual_clip_every}"
            )
        if not max_threshold_growth > 1:
            raise ValueError(f"max_threshold_growth must be above 1, got {max_threshold_growth}")
        self.process_group = process_group
        self.min_sparsity = min_sparsity
        self.max_sparsity = max_sparsity
        self.threshold_decay = threshold_decay
        self.residual_clip_factor = residual_clip_factor
        self.residual_clip_every = residual_clip_every
        self.max_threshold_growth = max_threshold_growth
        self.threshold = initial_threshold
        self.step = 0
        """Completed steps (hook rounds over all buckets)."""
        self.bytes_sent = 0
        self.dense_bytes = 0
        self.bitmap_exchanges = 0
        """Bucket exchanges that went as bitmaps (all ranks count the same)."""
        self._residuals: dict[int, torch.Tensor] = {}
        self._parameter_keys: dict[int, int] = {}
        self._step_encoded = 0
        self._step_elements = 0

    def state_dict(self) -> dict:
        """Threshold, step, counters and this rank's residuals (keyed by parameter), torch.load(weights_only)-safe."""
        return {
            "threshold": self.threshold,
            "step": self.step,
            "bytes_sent": self.bytes_sent,
            "dense_bytes": self.dense_bytes,
            "bitmap_exchanges": self.bitmap_exchanges,
            "residuals": {key: residual.detach().clone() for key, residual in self._residuals.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict(), before the DDP wrapper's first backward (residuals are matched to parameters
        by DDP's initial bucket layout); they move to each parameter's device when its bucket is reduced."""
        self.threshold = float(state["threshold"])
        self.step = int(state["step"])
        self.bytes_sent = int(state["bytes_sent"])
        self.dense_bytes = int(state["dense_bytes"])
        self.bitmap_exchanges = int(state["bitmap_exchanges"])
        self._residuals = {int(key): residual for key, residual in state["residuals"].items()}
        self._parameter_keys = {}

    def _accumulate(self, bucket: dist.GradBucket) -> tuple[torch.Tensor, list[int], list[int]]:
        """residual + gradient for the bucket (fp32), and the keys and sizes of its parameters in bucket order."""
        gradient = bucket.buffer()
        keys, sizes, parts = [], [], []
        for parameter in bucket.parameters():
            key = self._parameter_keys.setdefault(id(parameter), len(self._parameter_keys))
            residual = self._residuals.get(key)
            if residual is None:
                residual = torch.zeros(parameter.numel(), dtype=torch.float32, device=gradient.device)
            elif residual.numel() != parameter.numel():
                raise ValueError(
                    f"the residual for parameter #{key} has {residual.numel()} entries but the parameter has "
                    f"{parameter.numel()}: the compression state belongs to a different model"
                )
            keys.append(key)
            sizes.append(parameter.numel())
            parts.append(residual.to(device=gradient.device, dtype=torch.float32))
        return torch.cat(parts).add_(gradient), keys, sizes

    def _keep_residual(self, residual: torch.Tensor, keys: list[int], sizes: list[int]) -> None:
        self._residuals.update(zip(keys, residual.split(sizes), strict=True))

    def _finish_step(self, world_size: int) -> None:
        fraction = self._step_encoded / (world_size * self._step_elements)
        self.threshold = adapt_threshold(
            self.threshold,
            fraction,
            min_sparsity=self.min_sparsity,
            max_sparsity=self.max_sparsity,
            decay=self.threshold_decay,
            max_growth=self.max_threshold_growth,
        )
        self.step += 1
        self._step_encoded = self._step_elements = 0


def threshold_hook(state: ThresholdCompression, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: exchange the bucket threshold-encoded; resolves to the mean decoded update."""
    group = state.process_group
    world_size = dist.get_world_size(group)
    gradient = bucket.buffer()
    numel = gradient.numel()
    if numel >= torch.iinfo(torch.int32).max:
        raise ValueError(f"a bucket of {numel} elements is too large for int32 indices; lower bucket_cap_mb")
    threshold = state.threshold
    accumulated, keys, sizes = state._accumulate(bucket)
    signs = ternary_signs(accumulated, threshold)

    # A count of -1 tells every rank that this rank's gradient holds a NaN or Inf.
    count = torch.where(gradient.isfinite().all(), signs.count_nonzero(), -1).to(torch.int32).reshape(1)
    counts = torch.empty(world_size, dtype=torch.int32, device=gradient.device)
    dist.all_gather_single(counts, count, group=group)
    counts_list = counts.tolist()
    all_finite = min(counts_list) >= 0
    state.bytes_sent += COUNT_BYTES
    state.dense_bytes += gradient.element_size() * numel
    state._step_elements += numel
    if all_finite:
        state._step_encoded += sum(counts_list)
        residual = subtract_encoded_(accumulated, signs, threshold)
        if (state.step + 1) % state.residual_clip_every == 0:
            clip_residual_(residual, state.residual_clip_factor, threshold)
        state._keep_residual(residual, keys, sizes)
    if bucket.is_last():
        state._finish_step(world_size)

    longest = max(counts_list)
    if not all_finite or longest == 0:
        # Like a dense all-reduce, a NaN/Inf on any rank reaches every rank (so a NaN guard or a gradient scaler
        # skips the step everywhere); the residuals stay as they were.
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(torch.full_like(gradient, 0.0 if all_finite else float("nan")))
        return done
    if longest * SPARSE_LIMIT_DIVISOR > numel:
        payload = pack_ternary(signs)
        state.bitmap_exchanges += 1

        def sign_sums(gathered: torch.Tensor) -> torch.Tensor:
            return unpack_ternary(gathered.view(world_size, -1), numel).sum(dim=0, dtype=torch.int32)
    else:
        indices = signs_to_indices(signs)
        payload = torch.nn.functional.pad(indices, (0, longest - len(indices)))

        def sign_sums(gathered: torch.Tensor) -> torch.Tensor:
            return indices_to_sign_sums(gathered, numel)

    state.bytes_sent += payload.numel() * payload.element_size()
    gathered = payload.new_empty(world_size * payload.numel())
    work = dist.all_gather_single(gathered, payload, group=group, async_op=True)
    scale = threshold / world_size

    def decode(future: torch.futures.Future) -> torch.Tensor:
        future.wait()
        return (sign_sums(gathered).to(torch.float32) * scale).to(gradient.dtype)

    return work.get_future().then(decode)
