"""threshold_hook: the DDP communication hook of sharedGradients, the collectives of steps 4, 6 and 7 of the
package's algorithm (every branch that picks one decided from values all ranks share)."""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, and rejects strings.
import torch
import torch.distributed as dist

from tandem.worker.train.compression.accumulation import sparsify
from tandem.worker.train.compression.encoding import (
    indices_to_sign_sums,
    pack_ternary,
    signs_to_indices,
    unpack_ternary,
    uses_bitmap,
)
from tandem.worker.train.compression.hook_state import ThresholdCompression
from tandem.worker.train.compression.threshold import CALIBRATION_BYTES


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
        state.wait(dist.all_gather_single(values, mine, group=group, async_op=True))
        state.calibrate(values.view(world_size, -1).tolist(), keys)
        state.bytes_sent += CALIBRATION_BYTES * mine.numel()
    threshold = state.thresholds(keys, sizes, gradient.device)
    encoded = sparsify(accumulated, velocity, threshold, momentum_masking=state.settings.momentum_masking)
    signs = encoded.signs

    # A count of -1 tells every rank that this rank's gradient holds a NaN or Inf.
    count = torch.where(gradient.isfinite().all(), signs.count_nonzero(), -1).to(torch.int32).reshape(1)
    counts = torch.empty(world_size, dtype=torch.int32, device=gradient.device)
    state.wait(dist.all_gather_single(counts, count, group=group, async_op=True))
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
