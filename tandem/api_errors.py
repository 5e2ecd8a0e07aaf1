"""What the operator and rank 0 share about the Kubernetes API's errors: which answers are transient, how long to
wait before trying again (jittered, exponential, capped, never sooner than the server's Retry-After), and what the
server said. Both sides retry under these rules (operator/api_policy.py for every call the operator makes,
worker/train/status_sink.py for rank 0's status). Torch-free and client-free: an error is read through the
`status`, `headers` and `body` the `kubernetes` client's ApiException carries."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

TRANSIENT_CODES = frozenset({429, 500, 502, 503, 504})
"""Answers worth trying again: too many requests (API Priority and Fairness), and the server's own failures."""


@dataclass(frozen=True)
class Backoff:
    """Jittered exponential delays ("equal jitter"): attempt n waits a random time in [c/2, c] where
    c = min(cap, base * 2^n), and never less than the server's Retry-After. `attempts`: how many tries one call
    gets, where a caller gives up at all."""

    base: float = 0.2
    cap: float = 3.0
    attempts: int = 6

    def delay(self, attempt: int, retry_after: float | None = None, rng: random.Random | None = None) -> float:
        ceiling = min(self.cap, self.base * 2 ** attempt)
        jittered = (rng or random).uniform(ceiling / 2, ceiling)
        return max(jittered, retry_after or 0.0)


def retry_after(error: Any) -> float | None:
    """The seconds the server asked to wait: the Retry-After header, else the Status' details.retryAfterSeconds."""
    value = (getattr(error, "headers", None) or {}).get("Retry-After")
    if value is None:
        value = (status_body(error).get("details") or {}).get("retryAfterSeconds")
    try:
        seconds = float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
    return seconds if seconds is not None and seconds >= 0 else None


def api_message(error: Any) -> str:
    """The API server's own words: the Status' message, else the body as it came."""
    return str(status_body(error).get("message") or getattr(error, "body", None) or "").strip()


def status_body(error: Any) -> dict[str, Any]:
    """The error's body as a Kubernetes Status object ({} when it is not JSON)."""
    try:
        body = json.loads(getattr(error, "body", None) or "")
    except (TypeError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}
