"""What the sharedGradients hook does: its settings, checked once (the algorithm is in the package's docstring)."""

from dataclasses import dataclass

from tandem.worker.train.compression.encoding import SPARSE_LIMIT_DIVISOR

CALIBRATIONS = ("off", "shared", "perParameter")


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
