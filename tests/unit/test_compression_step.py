"""sharedGradients' compression step on tiny tensors, no process group: each technique of Deep Gradient Compression
(momentum correction, momentum factor masking, local gradient clipping, sparsity warm-up) and the threshold
calibration, table by table, against values worked out by hand. The hook on real ranks is in
integration/test_compression.py."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.api import ParallelTrainingJobSpec
from tandem.worker.train.compression import Settings, ThresholdCompression
from tandem.worker.train.compression.accumulation import accumulate, sparsify
from tandem.worker.train.compression.encoding import payload_bytes, uses_bitmap
from tandem.worker.train.compression.threshold import calibration_value, calibration_values, warmup_factor
from tandem.worker.train.modes import compression_settings, without_momentum


def tensor(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


GRADIENT = tensor(0.3, -0.2, 0.05)
RESIDUAL = tensor(0.1, 0.1, -0.1)
VELOCITY = tensor(1.0, 0.0, -1.0)
SIZES = [2, 1]
"""Two parameters: the first two entries and the last one."""

# (case, accumulate's keyword arguments, expected accumulated values, expected velocity)
ACCUMULATE = [
    ("DL4J: the residual plus the raw gradient; no velocity", {},
     tensor(0.4, -0.1, -0.05), None),
    ("momentum correction (DGC): velocity = 0.9 velocity + gradient, accumulated instead of the gradient",
     {"momentum_correction": True, "momentum": 0.9, "gain": 1.0},
     tensor(1.3, -0.1, -0.95), tensor(1.2, -0.2, -0.85)),
    ("momentum correction with a shorter memory: velocity = 0.5 velocity + 5 gradient (gain (1 - 0.5) / (1 - 0.9))",
     {"momentum_correction": True, "momentum": 0.5, "gain": 5.0},
     tensor(2.1, -0.9, -0.35), tensor(2.0, -1.0, -0.25)),
    ("local gradient clipping: the first parameter's gradient (norm 0.3606) scaled to norm 0.25, the second left",
     {"local_gradient_clip": 0.25},
     tensor(0.1 + 0.3 * 0.25 / math.hypot(0.3, 0.2), 0.1 - 0.2 * 0.25 / math.hypot(0.3, 0.2), -0.05), None),
    ("clipping comes before the velocity",
     {"local_gradient_clip": 0.25, "momentum_correction": True, "momentum": 0.9, "gain": 1.0},
     tensor(0.1 + 0.9 + 0.3 * 0.25 / math.hypot(0.3, 0.2), 0.1 - 0.2 * 0.25 / math.hypot(0.3, 0.2), -0.95),
     tensor(0.9 + 0.3 * 0.25 / math.hypot(0.3, 0.2), -0.2 * 0.25 / math.hypot(0.3, 0.2), -0.85)),
]


@pytest.mark.parametrize(("case", "options", "accumulated", "velocity"), ACCUMULATE,
                         ids=[case.split(":")[0] for case, *_ in ACCUMULATE])
def test_accumulate(case, options, accumulated, velocity) -> None:
    gradient, residual, previous = GRADIENT.clone(), RESIDUAL.clone(), VELOCITY.clone()
    got, new_velocity = accumulate(gradient, residual, previous, sizes=SIZES, **options)
    torch.testing.assert_close(got, accumulated, msg=case)
    if velocity is None:
        assert new_velocity is None, case
    else:
        torch.testing.assert_close(new_velocity, velocity, msg=case)
    # The inputs are the caller's state until the exchange goes ahead: left as they were.
    assert torch.equal(gradient, GRADIENT) and torch.equal(residual, RESIDUAL) and torch.equal(previous, VELOCITY)


ACCUMULATED = tensor(1.3, -0.1, -0.95, 0.5)
MOMENTUM = tensor(1.2, -0.2, -0.85, 0.4)

# (case, masking, expected signs, residual, velocity) at threshold 0.5
SPARSIFY = [
    ("without masking the velocity of a sent entry keeps pushing it", False,
     [1, 0, -1, 1], tensor(0.8, -0.1, -0.45, 0.0), MOMENTUM),
    ("masking zeroes the velocity of exactly the sent entries (|accumulated| >= threshold)", True,
     [1, 0, -1, 1], tensor(0.8, -0.1, -0.45, 0.0), tensor(0.0, -0.2, 0.0, 0.0)),
]


@pytest.mark.parametrize(("case", "masking", "signs", "residual", "velocity"), SPARSIFY,
                         ids=["no masking", "masking"])
def test_sparsify_and_momentum_factor_masking(case, masking, signs, residual, velocity) -> None:
    encoded = sparsify(ACCUMULATED.clone(), MOMENTUM.clone(), 0.5, momentum_masking=masking)
    assert encoded.signs.tolist() == signs, case
    torch.testing.assert_close(encoded.residual, residual, msg=case)
    torch.testing.assert_close(encoded.velocity, velocity, msg=case)


@pytest.mark.parametrize(("momentum", "optimizer_momentum", "gain"), [
    (None, 0.9, 1.0),  # DGC: the optimizer's momentum, nothing to compensate
    (0.7, 0.9, 3.0),  # the default: (1 - 0.7) / (1 - 0.9)
    (0.0, 0.9, 10.0),  # no memory at all: each gradient enters at its steady-state weight
    (0.5, 0.0, 0.5),  # an optimizer without momentum: the velocity averages, the step is unchanged
])
def test_the_velocity_gain_keeps_the_steady_state_step(momentum, optimizer_momentum, gain) -> None:
    settings = Settings(momentum_correction=True, momentum=momentum, optimizer_momentum=optimizer_momentum)
    assert settings.velocity_gain == pytest.approx(gain)
    # A steady gradient g: the velocity settles at gain * g / (1 - momentum) = g / (1 - optimizer momentum).
    velocity, gradient = torch.zeros(1), torch.ones(1)
    for _ in range(400):
        _, velocity = accumulate(gradient, torch.zeros(1), velocity, sizes=[1], momentum_correction=True,
                                 momentum=settings.velocity_momentum, gain=settings.velocity_gain)
    assert velocity.item() == pytest.approx(1 / (1 - optimizer_momentum), rel=1e-4)


@pytest.mark.parametrize(("step", "factor"), [(0, 16.0), (1, 8.0), (2, 4.0), (3, 2.0), (4, 1.0), (9, 1.0)])
def test_the_warmup_narrows_the_band_geometrically(step, factor) -> None:
    assert warmup_factor(step, warmup_steps=4, warmup_sparsity=0.16, max_sparsity=0.01) == pytest.approx(factor)


def test_no_warmup_and_a_start_below_the_band_leave_it_alone() -> None:
    assert warmup_factor(0, warmup_steps=0, warmup_sparsity=0.16, max_sparsity=0.01) == 1.0
    assert warmup_factor(0, warmup_steps=10, warmup_sparsity=0.005, max_sparsity=0.01) == 1.0
    state = ThresholdCompression(min_sparsity=1e-3, max_sparsity=1e-2, warmup_steps=2, warmup_sparsity=0.04)
    assert state.band() == pytest.approx((4e-3, 4e-2))
    state.step = 1
    assert state.band() == pytest.approx((2e-3, 2e-2))
    state.step = 2
    assert state.band() == pytest.approx((1e-3, 1e-2))


@pytest.mark.parametrize(("fraction", "value"), [(0.0, 0.5), (0.2, 0.5), (0.4, 0.3), (0.5, 0.2), (1.0, 0.05)])
def test_calibration_value_is_the_magnitude_the_top_fraction_reaches(fraction, value) -> None:
    assert calibration_value(tensor(0.1, -0.5, 0.3, -0.2, 0.05), fraction) == pytest.approx(value)


def test_calibration_takes_the_mean_of_the_ranks_values_once_and_waits_out_a_nan() -> None:
    state = ThresholdCompression(calibration="shared", initial_threshold=1e-3)
    assert state.wants_calibration()
    state.calibrate([[math.nan], [0.4]], keys=[0])
    assert state.threshold == 1e-3 and state.wants_calibration()
    state.calibrate([[0.2], [0.4]], keys=[0])
    assert state.threshold == pytest.approx(0.3)
    assert state.wants_calibration(), "the step's other buckets are calibrated too"
    state.count([1, 1], 10, 4)
    state.finish_step(2)
    assert not state.wants_calibration()
    assert state.thresholds([0], [10], torch.device("cpu")) == state.threshold  # shared: one float
    assert not ThresholdCompression().wants_calibration()  # off in the hook's own defaults (DL4J)


def test_per_parameter_calibration_gives_each_parameter_its_ratio_with_a_floor() -> None:
    state = ThresholdCompression(calibration="perParameter", parameter_floor=0.01)
    # Two ranks' rows: the bucket's value, then each parameter's.
    state.calibrate([[0.2, 0.1, 0.001], [0.4, 0.3, 0.0]], keys=[0, 1])
    assert state.threshold == pytest.approx(0.3)
    assert state.state_dict()["ratios"] == pytest.approx({0: 0.2 / 0.3, 1: 0.01})  # 0.0005 is under the floor
    torch.testing.assert_close(state.thresholds([0, 1], [2, 1], torch.device("cpu")), tensor(0.2, 0.2, 0.003))
    accumulated = tensor(0.25, -0.1, 0.004)
    values = calibration_values(accumulated, [2, 1], 0.5, per_parameter=True)
    assert values == pytest.approx([0.1, 0.25, 0.004])


@pytest.mark.parametrize(("counts", "numel", "bitmap", "payload"), [
    ([10, 3], 160, False, 40),  # 10 entries are 1/16 of 160: still an index list, padded to the longest
    ([11, 0], 160, True, 40),  # past 1/16: a 2-bit bitmap, 160 / 4 bytes
    ([0, 0], 160, False, 0),  # nothing encoded anywhere: nothing sent after the counts
])
def test_the_shared_counts_decide_the_payload(counts, numel, bitmap, payload) -> None:
    assert uses_bitmap(counts, numel) is bitmap
    assert payload_bytes(counts, numel) == payload


@pytest.mark.parametrize("options", [
    {"initial_threshold": 0.0}, {"min_sparsity": 0.1, "max_sparsity": 0.01}, {"threshold_decay": 1.0},
    {"residual_clip_every": 0}, {"max_threshold_growth": 1.0}, {"momentum": 1.0}, {"optimizer_momentum": -0.1},
    {"local_gradient_clip": 0.0}, {"warmup_steps": -1}, {"warmup_sparsity": 0.0}, {"calibration": "yes"},
    {"parameter_floor": 0.0},
])
def test_bad_settings_are_refused(options: dict) -> None:
    with pytest.raises(ValueError):
        Settings(**options)


def _local_steps(state: ThresholdCompression, gradients: list[torch.Tensor]) -> list[torch.Tensor]:
    """The per-rank half of the hook on one bucket of two parameters, the exchange left out: (signs per step)."""
    keys, sizes = [0, 1], [3, 2]
    sent = []
    for gradient in gradients:
        accumulated, velocity = state.accumulate(gradient, keys, sizes)
        if state.wants_calibration():
            state.calibrate([state.calibration_values(accumulated, sizes)], keys)
        threshold = state.thresholds(keys, sizes, gradient.device)
        encoded = sparsify(accumulated, velocity, threshold, momentum_masking=state.settings.momentum_masking)
        counts = [int(encoded.signs.count_nonzero())]
        state.count(counts, 5, 4)
        state.keep(encoded, keys, sizes, threshold)
        state.finish_step(1)
        sent.append(encoded.signs)
    return sent


CORRECTED = {"momentum_correction": True, "optimizer_momentum": 0.9, "momentum": 0.7, "momentum_masking": True,
             "calibration": "perParameter", "warmup_steps": 2, "max_sparsity": 0.2, "residual_clip_every": 2}


def test_a_state_saved_and_loaded_between_steps_continues_exactly() -> None:
    generator = torch.Generator().manual_seed(0)
    gradients = [torch.randn(5, generator=generator) for _ in range(6)]
    straight = ThresholdCompression(**CORRECTED)
    expected = _local_steps(straight, gradients)

    first = ThresholdCompression(**CORRECTED)
    _local_steps(first, gradients[:3])
    saved = first.state_dict()
    assert saved["velocities"].keys() == saved["residuals"].keys() == {0, 1}
    assert saved["calibrated"] is True and saved["ratios"].keys() == {0, 1}
    second = ThresholdCompression(**CORRECTED)
    second.load_state_dict(saved)
    assert [s.tolist() for s in _local_steps(second, gradients[3:])] == [s.tolist() for s in expected[3:]]
    assert second.state_dict()["threshold"] == straight.threshold
    for key in (0, 1):
        assert torch.equal(second.state_dict()["velocities"][key], straight.state_dict()["velocities"][key])
        assert torch.equal(second.state_dict()["residuals"][key], straight.state_dict()["residuals"][key])


def test_the_report_counts_entries_sent_and_bitmap_steps() -> None:
    state = ThresholdCompression(initial_threshold=0.5)
    state.count([1, 0], 20, 4)  # one entry of 40 offered: an index list
    state.finish_step(2)
    state.count([2, 1], 20, 4)  # 2 > 20 / 16: a bitmap
    state.finish_step(2)
    state.count([-1, 0], 20, 4)  # a NaN on one rank: nothing exchanged, nothing counted as offered
    state.finish_step(2)
    report = state.report()
    assert report["sent_fraction"] == pytest.approx(4 / 80)
    assert report["bitmap_steps"] == 1 and state.step == 3
    assert report["threshold"] == state.threshold


def _spec(**shared) -> ParallelTrainingJobSpec:
    return ParallelTrainingJobSpec.model_validate({
        "trainingMode": "sharedGradients", "sharedGradients": shared,
        "trainer": {"model": "m:f", "data": "d:f", "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9,
                                                                 "weightDecay": 1e-4}},
    })


def test_the_spec_maps_onto_the_hook_and_the_optimizer() -> None:
    settings = Settings(**compression_settings(_spec()))
    assert settings.momentum_correction and settings.optimizer_momentum == 0.9 and settings.momentum == 0.7
    assert settings.calibration == "perParameter"
    optimizer = without_momentum(_spec().trainer.optimizer)
    assert optimizer.momentum == 0.0 and optimizer.weight_decay == pytest.approx(1e-3) and optimizer.lr == 0.1

    dl4j = Settings(**compression_settings(_spec(momentumCorrection={"enabled": False}, calibration="off",
                                                 warmup={"steps": 0}, targetSparsity={"min": 1e-4, "max": 1e-2})))
    assert not dl4j.momentum_correction and dl4j.calibration == "off" and dl4j.warmup_steps == 0

    adam = _spec().model_copy(update={"trainer": _spec().trainer.model_copy(update={
        "optimizer": _spec().trainer.optimizer.model_copy(update={"name": "adam"})})})
    assert not Settings(**compression_settings(adam)).momentum_correction  # Adam keeps its own moments


def test_rank_0_publishes_what_the_compression_did_while_training() -> None:
    from tandem.worker.train.reporting import Reporter

    published: list[dict] = []

    class Recorder:
        def publish(self, status) -> None:
            published.append(status.to_dict())

        def close(self) -> None:
            pass

    state = ThresholdCompression(initial_threshold=0.5)
    state.count([1, 0], 20, 4)  # 1 of 40 entries: above the band's top (1e-2), so the threshold doubles
    state.finish_step(2)
    reporter = Reporter([Recorder()], workers=2, total_steps=10, interval=0.0, compression=state.report)
    reporter.progress(epoch=1, step=1, loss=0.5, samples=64)
    assert published[-1]["communication"] == {"bytesSent": 0, "denseBytes": 0, "threshold": 1.0,
                                              "sentFraction": 0.025, "bitmapSteps": 0}
    status = reporter.final("Succeeded", "done", epoch=1, metrics={}, bytes_sent=88, dense_bytes=160)
    assert status.communication.bytes_sent == 88 and status.communication.threshold == 1.0
