"""trainingMode sharedGradients: DL4J's SHARED_GRADIENTS (Strom-style threshold encoding) as a DDP comm hook,
with Deep Gradient Compression's corrections (Lin et al., ICLR 2018) on top.

One module per concern: settings.py (what the hook does, Settings), accumulation.py (steps 1-3 and 5: local
clipping, momentum correction, the residual and momentum masking), threshold.py (step 4, the calibration, and
step 8, the threshold's adaptation), encoding.py (the ternary encodings, their wire formats and the bytes they
take), hook_state.py (ThresholdCompression: the state the hook keeps between buckets and steps, its counters and
checkpoint) and hook.py (threshold_hook: the DDP communication hook, steps 6 and 7, the collectives).

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

from tandem.worker.train.compression.hook import threshold_hook
from tandem.worker.train.compression.hook_state import ThresholdCompression
from tandem.worker.train.compression.settings import Settings

__all__ = ["Settings", "ThresholdCompression", "threshold_hook"]
