"""What `kubectl get ptj` / `tip` print, as text: an API server prints a CRD's `number` column at full precision
and cannot format it, so the statuses carry these texts beside the exact numbers (which stay for machines).

- a loss (and a pool's gate metric) to four significant figures (`0.06094`, `2.000`, `1.234e-05`); `NaN`, `Inf`
  or `-Inf` for one that is not finite (a diverged step), never an error;
- samples per second as whole numbers from 100 up, three significant figures below (`1523`, `45.2`, `0.452`);
- an ETA as kubectl prints an age (Kubernetes' HumanDuration: `45s`, `2m5s`, `65m`, `3h5m`, `2d`);
- a checkpoint's file name (`step-00000230.pt`): the full path stays in the status.
"""

from __future__ import annotations

import math
from pathlib import PurePosixPath


def four_figures(value: float | None) -> str | None:
    if value is None:
        return None
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Inf" if value > 0 else "-Inf"
    # `#` keeps the trailing zeros of four significant figures (`2.000`), and a bare point (`1234.`) once digits
    # fill them.
    return f"{value:#.4g}".removesuffix(".")


def rate_text(per_second: float | None) -> str | None:
    if per_second is None or not math.isfinite(per_second) or per_second < 0:
        return None
    return f"{per_second:.0f}" if per_second >= 100 else f"{per_second:.3g}"


def human_duration(seconds: float) -> str:
    """Kubernetes' duration.HumanDuration: how kubectl and the API server print an age."""
    if int(seconds) < -1:
        return "<invalid>"
    if seconds < 0:
        return "0s"
    if seconds < 120:
        return f"{int(seconds)}s"
    minutes, hours = int(seconds // 60), int(seconds // 3600)
    if minutes < 10:
        rest = int(seconds) % 60
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def eta_text(seconds: float | None) -> str | None:
    if seconds is None or not math.isfinite(seconds):
        return None
    return human_duration(max(0.0, seconds))


def file_name(path: str | None) -> str | None:
    return (PurePosixPath(path).name or None) if path else None
