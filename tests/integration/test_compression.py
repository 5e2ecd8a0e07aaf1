"""sharedGradients (tandem.worker.train.compression): the encode/decode pieces alone, then the hook on 2 real gloo
ranks."""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as objects.
import io
import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_on_ranks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from tandem.examples.digits import eval_data, mlp, train_data
from tandem.worker.train.compression import ThresholdCompression, threshold_hook
from tandem.worker.train.compression.accumulation import clip_residual_, subtract_encoded_
from tandem.worker.train.compression.encoding import (
    indices_to_sign_sums,
    pack_ternary,
    signs_to_indices,
    ternary_signs,
    unpack_ternary,
)
from tandem.worker.train.compression.threshold import adapt_threshold

BATCH_PER_RANK = 32
DIGITS_EPOCHS = 30
"""The digits example's budget (examples/digits-train-shared.yaml)."""
SMALL_BUCKETS_MB = 0.02
"""Small enough that DDP rebuilds the digits MLP's single first bucket into two after the first step."""
RESUME_STEPS = 10


def random_signs(numel: int, seed: int) -> torch.Tensor:
    return torch.randint(-1, 2, (numel,), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


# --- the pieces, no process group ---------------------------------------------------------------------------


def test_entries_at_or_beyond_the_threshold_are_encoded_and_the_rest_stays_in_the_residual() -> None:
    accumulated = torch.tensor([0.5, -0.25, 0.05, -0.1, 0.1, 0.0, -0.09])
    signs = ternary_signs(accumulated, 0.1)
    assert signs.dtype == torch.int8
    assert signs.tolist() == [1, -1, 0, -1, 1, 0, 0]
    residual = subtract_encoded_(accumulated, signs, 0.1)
    assert residual is accumulated
    torch.testing.assert_close(residual, torch.tensor([0.4, -0.15, 0.05, 0.0, 0.0, 0.0, -0.09]))


def test_residual_clipping_bounds_the_residual_to_factor_times_threshold() -> None:
    residual = torch.tensor([0.9, -0.7, 0.2, -0.1])
    assert clip_residual_(residual, 5.0, 0.1) is residual
    torch.testing.assert_close(residual, torch.tensor([0.5, -0.5, 0.2, -0.1]))


def test_signed_indices_round_trip_and_sum_over_ranks_with_padding() -> None:
    first, second = random_signs(1000, seed=1), random_signs(1000, seed=2)
    first[0], first[-1] = -1, 1  # both ends of the bucket
    indices = signs_to_indices(first)
    assert indices.dtype == torch.int32
    assert len(indices) == first.count_nonzero() and bool((indices != 0).all())
    assert torch.equal(indices_to_sign_sums(indices, 1000), first.int())

    longest = max(int(first.count_nonzero()), int(second.count_nonzero())) + 3
    padded = [F.pad(signs_to_indices(signs), (0, longest - int(signs.count_nonzero()))) for signs in (first, second)]
    assert torch.equal(indices_to_sign_sums(torch.cat(padded), 1000), first.int() + second.int())


@pytest.mark.parametrize("numel", [1, 3, 4, 5, 1001])
def test_ternary_bitmap_round_trip_at_two_bits_per_element(numel: int) -> None:
    first, second = random_signs(numel, seed=numel), random_signs(numel, seed=numel + 1)
    bitmap = pack_ternary(first)
    assert bitmap.dtype == torch.uint8 and len(bitmap) == math.ceil(numel / 4)
    assert torch.equal(unpack_ternary(bitmap, numel), first)
    gathered = torch.cat([bitmap, pack_ternary(second)]).view(2, -1)
    assert torch.equal(unpack_ternary(gathered, numel), torch.stack([first, second]))


def test_threshold_adapts_toward_the_target_band() -> None:
    band = {"min_sparsity": 1e-4, "max_sparsity": 1e-2, "decay": 0.8}
    assert adapt_threshold(1.0, 5e-3, **band, max_growth=2.0) == 1.0  # inside the band
    assert adapt_threshold(1.0, 1e-5, **band, max_growth=2.0) == pytest.approx(0.8)  # too sparse: DL4J's step
    assert adapt_threshold(1.0, 1.1e-2, **band, max_growth=2.0) == pytest.approx(1.25)  # just above: DL4J's step
    assert adapt_threshold(1.0, 1.5e-2, **band, max_growth=2.0) == pytest.approx(1.5)  # by the overshoot
    assert adapt_threshold(1.0, 0.5, **band, max_growth=2.0) == pytest.approx(2.0)  # capped
    assert adapt_threshold(1.0, 0.5, **band, max_growth=1 / 0.8) == pytest.approx(1.25)  # DL4J's rule exactly


@pytest.mark.parametrize("options", [
    {"initial_threshold": 0.0}, {"min_sparsity": 0.1, "max_sparsity": 0.01}, {"threshold_decay": 1.0},
    {"residual_clip_every": 0}, {"max_threshold_growth": 1.0},
])
def test_bad_settings_are_refused(options: dict) -> None:
    with pytest.raises(ValueError):
        ThresholdCompression(**options)


# --- 2 gloo ranks --------------------------------------------------------------------------------------------


def _local_gradients(model: DistributedDataParallel, inputs: torch.Tensor) -> list[torch.Tensor]:
    """This rank's own gradients (no exchange), for checking the hook against a reference."""
    with model.no_sync():
        model(inputs).square().sum().backward()
    gradients = [parameter.grad.clone() for parameter in model.parameters()]
    model.zero_grad()
    return gradients


def _all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return gathered


class HandChecked:
    """A Linear(64, 64) under DDP with the hook, every exchange checked against the algorithm run by hand."""

    NUMEL = 64 * 64 + 64  # an encoding longer than 260 entries goes as a bitmap

    def __init__(self, initial_threshold: float) -> None:
        torch.manual_seed(0)
        self.model = DistributedDataParallel(torch.nn.Linear(64, 64))
        self.state = ThresholdCompression(initial_threshold=initial_threshold, residual_clip_every=1000)
        self.model.register_comm_hook(self.state, threshold_hook)
        self.residuals = [torch.zeros_like(parameter) for parameter in self.model.parameters()]

    def exchange(self, inputs: torch.Tensor) -> int:
        """One step's exchange, checked; returns how many entries this rank encoded."""
        local = _local_gradients(self.model, inputs)
        tau = self.state.threshold
        self.model(inputs).square().sum().backward()
        encoded = 0
        for parameter, gradient, residual in zip(self.model.parameters(), local, self.residuals, strict=True):
            accumulated = residual + gradient
            signs = ternary_signs(accumulated, tau)
            residual.copy_(subtract_encoded_(accumulated, signs, tau))
            sign_sums = torch.stack(_all_gather(signs)).sum(dim=0, dtype=torch.int32)
            assert torch.equal(parameter.grad, sign_sums.to(torch.float32) * (tau / 2))
            encoded += int(signs.count_nonzero())
        self.model.zero_grad()
        return encoded


def check_fallback_padding_and_nan(rank: int) -> None:
    # Rank 0's encoding is dense, rank 1's (bias gradients only) is sparse: both must take the bitmap.
    mixed = HandChecked(initial_threshold=1e-6)
    encoded = mixed.exchange(torch.randn(8, 64) if rank == 0 else torch.zeros(8, 64))
    assert encoded > HandChecked.NUMEL / 16 if rank == 0 else encoded == 64
    assert mixed.state.bitmap_exchanges == 1
    assert mixed.state.bytes_sent == 4 + math.ceil(HandChecked.NUMEL / 4)
    assert mixed.state.dense_bytes == 4 * HandChecked.NUMEL

    # Both sparse, rank 0 with 128 entries (one input column and the biases), rank 1 with 64: index lists,
    # rank 1's padded to rank 0's length.
    sparse = HandChecked(initial_threshold=1e-6)
    one_column = torch.zeros(8, 64)
    if rank == 0:
        one_column[:, 3] = 1.0
    assert sparse.exchange(one_column) == (128 if rank == 0 else 64)
    assert sparse.state.bitmap_exchanges == 0
    assert sparse.state.bytes_sent == 4 + 4 * 128

    # A NaN on one rank reaches every rank, as with a dense all-reduce, and the residuals stay as they were.
    before = sparse.state.state_dict()
    poisoned = torch.full((8, 64), math.nan) if rank == 1 else torch.zeros(8, 64)
    sparse.model(poisoned).square().sum().backward()
    assert all(bool(parameter.grad.isnan().all()) for parameter in sparse.model.parameters())
    after = sparse.state.state_dict()
    assert after["residuals"].keys() == before["residuals"].keys()
    assert all(torch.equal(before["residuals"][key], after["residuals"][key]) for key in before["residuals"])
    assert after["step"] == 2 and after["bytes_sent"] == before["bytes_sent"] + 4


def test_fallback_is_decided_from_shared_counts_and_every_update_is_the_exact_mean() -> None:
    run_on_ranks(check_fallback_padding_and_nan, world_size=2)


CORRECTED = {"momentum_correction": True, "optimizer_momentum": 0.9, "momentum": 0.7, "momentum_masking": True,
             "local_gradient_clip": 2.0, "calibration": "perParameter", "warmup_steps": 3, "warmup_sparsity": 0.05,
             "max_sparsity": 0.01, "residual_clip_every": 1000}


def _top(values: torch.Tensor, fraction: float) -> float:
    return float(values.abs().topk(math.ceil(fraction * values.numel())).values.min())


def check_corrections_by_hand(rank: int) -> None:
    """Every technique on at once, each exchange checked against the algorithm worked by hand on each parameter:
    local clipping, the velocity and its gain, the per-parameter calibration (the threshold the mean of the ranks'
    bucket values, each parameter's ratio the mean of theirs over it, at the warm-up's band top), masking of
    exactly the sent entries, and the kept residuals and velocities."""
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    state = ThresholdCompression(**CORRECTED)
    model.register_comm_hook(state, threshold_hook)
    parameters = list(model.parameters())
    residuals = [torch.zeros(p.numel()) for p in parameters]
    velocities = [torch.zeros(p.numel()) for p in parameters]
    ratios = [1.0, 1.0]
    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(5):
        inputs = torch.randn(8, 64, generator=generator)
        local = [gradient.flatten() for gradient in _local_gradients(model, inputs)]
        accumulated = []
        for index, gradient in enumerate(local):
            norm = float(gradient.norm())
            clipped = gradient * (2.0 / norm) if norm > 2.0 else gradient
            velocities[index] = 0.7 * velocities[index] + 3.0 * clipped  # gain (1 - 0.7) / (1 - 0.9)
            accumulated.append(residuals[index] + velocities[index])
        if step == 0:  # the warm-up's band top at step 0 is 0.05
            mine = torch.tensor([_top(torch.cat(accumulated), 0.05), *(_top(a, 0.05) for a in accumulated)])
            rows = torch.stack(_all_gather(mine)).tolist()
            means = [sum(column) / 2 for column in zip(*rows, strict=True)]
            tau = means[0]
            ratios = [max(mean, 0.01 * means[0]) / tau for mean in means[1:]]
            assert state.threshold == 1e-3, "calibrated before the first exchange"
        else:
            tau = state.threshold
        model(inputs).square().sum().backward()
        if step == 0:
            assert state.threshold == tau and state.calibrated
        for index, parameter in enumerate(parameters):
            threshold = torch.full((parameter.numel(),), ratios[index], dtype=torch.float32) * tau
            signs = ternary_signs(accumulated[index], threshold)
            residuals[index] = accumulated[index] - signs.float() * threshold
            velocities[index] = velocities[index].masked_fill(signs != 0, 0.0)
            sign_sums = torch.stack(_all_gather(signs)).sum(dim=0, dtype=torch.int32)
            torch.testing.assert_close(parameter.grad.flatten(), sign_sums.float() * (threshold / 2), rtol=0, atol=0)
        model.zero_grad()
        kept = state.state_dict()
        for index, parameter in enumerate(parameters):
            key = state._parameter_keys[id(parameter)]
            assert kept["ratios"][key] == ratios[index]
            torch.testing.assert_close(kept["residuals"][key], residuals[index], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(kept["velocities"][key], velocities[index], rtol=1e-5, atol=1e-6)
    assert ratios[0] != ratios[1], "the weight and the bias should have their own thresholds"
    assert state.step == 5


def test_every_correction_on_two_ranks_matches_the_algorithm_by_hand() -> None:
    run_on_ranks(check_corrections_by_hand, world_size=2)


class LayoutRecordingCompression(ThresholdCompression):
    """The hook state, also noting each exchanged bucket's size, so a test can see DDP rebuild its buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.bucket_sizes: list[tuple[int, int]] = []


def recording_hook(state: LayoutRecordingCompression, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.bucket_sizes.append((state.step, bucket.buffer().numel()))
    return threshold_hook(state, bucket)


def _digits_replica() -> tuple[DistributedDataParallel, torch.optim.Optimizer, LayoutRecordingCompression]:
    torch.manual_seed(0)
    model = DistributedDataParallel(mlp(), bucket_cap_mb=SMALL_BUCKETS_MB)
    state = LayoutRecordingCompression()
    model.register_comm_hook(state, recording_hook)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), state


def _flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([parameter.detach().flatten() for parameter in model.parameters()])


def _train_steps(
    model: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    check_replicas: bool = False,
) -> None:
    for inputs, targets in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        if check_replicas:
            mine = _flat_parameters(model)
            assert all(torch.equal(mine, other) for other in _all_gather(mine)), "replicas differ"


def check_identical_replicas_and_exact_resume(rank: int) -> None:
    inputs, targets = train_data().tensors
    generator = torch.Generator().manual_seed(rank)
    picks = [torch.randint(len(inputs), (BATCH_PER_RANK,), generator=generator) for _ in range(2 * RESUME_STEPS)]
    batches = [(inputs[pick], targets[pick]) for pick in picks]

    model, optimizer, state = _digits_replica()
    _train_steps(model, optimizer, batches, check_replicas=True)
    uninterrupted = _flat_parameters(model)
    first_layout = {size for step, size in state.bucket_sizes if step == 0}
    later_layout = {size for step, size in state.bucket_sizes if step > 0}
    assert first_layout != later_layout, "DDP did not rebuild its buckets; the test lost its point"
    assert state.bitmap_exchanges > 0, "no bitmap exchange"
    assert state.bytes_sent < state.dense_bytes / 16, "no index-list exchange"

    model, optimizer, state = _digits_replica()
    _train_steps(model, optimizer, batches[:RESUME_STEPS])
    checkpoint = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "compression": state.state_dict()}, checkpoint)
    model, optimizer, state = _digits_replica()  # a fresh DDP: its first step has the initial bucket layout again
    saved = torch.load(io.BytesIO(checkpoint.getvalue()), weights_only=True)
    model.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state.load_state_dict(saved["compression"])
    _train_steps(model, optimizer, batches[RESUME_STEPS:])
    assert torch.equal(_flat_parameters(model), uninterrupted), "resumed run differs from the uninterrupted one"


def test_replicas_stay_bit_identical_through_a_bucket_rebuild_and_a_resume_is_exact() -> None:
    run_on_ranks(check_identical_replicas_and_exact_resume, world_size=2)


@dataclass
class DigitsRun:
    accuracy: float
    parameters: torch.Tensor
    bytes_sent: int | None
    dense_bytes: int | None


def train_digits(
    rank: int, mode: str, epochs: int, seed: int = 0, compression_options: dict | None = None
) -> DigitsRun:
    """Train the digits MLP under DDP, in mode "allReduce" (DDP's own all-reduce) or "sharedGradients"
    (threshold_hook): SGD lr 0.05 momentum 0.9, batch 32 per rank, DistributedSampler."""
    torch.manual_seed(seed)
    model = DistributedDataParallel(mlp())
    compression = None
    if mode == "sharedGradients":
        compression = ThresholdCompression(**(compression_options or {}))
        model.register_comm_hook(compression, threshold_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = train_data()
    sampler = DistributedSampler(data, seed=seed)
    loader = DataLoader(data, batch_size=BATCH_PER_RANK, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        _train_steps(model, optimizer, list(loader))
    inputs, targets = eval_data().tensors
    with torch.no_grad():
        accuracy = (model.module(inputs).argmax(dim=1) == targets).float().mean().item()
    return DigitsRun(
        accuracy=accuracy,
        parameters=_flat_parameters(model),
        bytes_sent=compression.bytes_sent if compression else None,
        dense_bytes=compression.dense_bytes if compression else None,
    )


def test_digits_trains_to_96_percent_sending_under_half_a_percent_of_the_dense_bytes() -> None:
    runs = run_on_ranks(train_digits, "sharedGradients", DIGITS_EPOCHS, world_size=2)
    assert torch.equal(runs[0].parameters, runs[1].parameters)
    fraction = sum(run.bytes_sent for run in runs) / sum(run.dense_bytes for run in runs)
    # Measured (seed 0, 30 epochs): accuracy 0.9805 at 0.296% of the dense bytes.
    assert runs[0].accuracy >= 0.96, f"eval accuracy {runs[0].accuracy:.3f}"
    assert fraction <= 0.004, f"sent {fraction:.3%} of the dense bytes"
