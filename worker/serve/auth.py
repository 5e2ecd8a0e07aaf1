"""A bearer token in front of an inference server's data plane (the pool's `auth`): the HTTP layer and the gRPC
service both ask `BearerToken.allows` of a request's `Authorization` value (HTTP header; gRPC metadata key
`authorization`); health and readiness never ask, so the kubelet's probes stay open.

The token is a file's content (the pool's Secret, mounted by the operator; `tandem serve --auth-token-file`),
stripped of surrounding whitespace, read again when the file changes (a rotated Secret's new token is accepted
without a restart; the kubelet updates a mounted Secret in place). Compared in constant time.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import re
from pathlib import Path

SCHEME = "bearer"
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})
"""HTTP paths that never ask for the token (with each model's readiness, and /metrics unless protected)."""
METRICS_PATH = "/metrics"
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="tandem"'}
"""The header of an HTTP 401 (RFC 6750)."""
OPEN_RPCS = frozenset({"ServerLive", "ServerReady", "ModelReady"})
"""gRPC methods of inference.GRPCInferenceService that never ask for the token."""
_MODEL_READY = re.compile(r"^/v2/models/[^/]+(?:/versions/[^/]+)?/ready$")


def path_needs_token(path: str, metrics_protected: bool) -> bool:
    """Whether an HTTP request to `path` must carry the token: everything but health, readiness and (unless the
    pool protects it) /metrics."""
    if path in OPEN_PATHS or _MODEL_READY.match(path):
        return False
    return metrics_protected or path != METRICS_PATH


def rpc_needs_token(method: str) -> bool:
    """Whether a gRPC call (its full method name, `/inference.GRPCInferenceService/ModelInfer`) must carry the
    token: everything but liveness and readiness."""
    return method.rpartition("/")[2] not in OPEN_RPCS


def refusal(authorization: str | bytes | None) -> str:
    """Why a request with this `Authorization` value (not allowed) is refused, and the fix."""
    if not authorization:
        return "this endpoint needs the pool's bearer token: send the header Authorization: Bearer <token>"
    return "the bearer token is not the pool's (spec.auth's Secret): send Authorization: Bearer <token>"


class AuthTokenError(ValueError):
    """The token file cannot be read, or holds no token."""


class BearerToken:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self._token = b""
        self._refresh()

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether an `Authorization` value (`Bearer <token>`, the scheme in any case) carries the token."""
        if not authorization:
            return False
        if isinstance(authorization, str):
            authorization = authorization.encode("latin-1", "replace")
        scheme, _, presented = authorization.strip().partition(b" ")
        if scheme.lower() != SCHEME.encode():
            return False
        with contextlib.suppress(AuthTokenError):  # a Secret being rotated (the file briefly gone): the last holds
            self._refresh()
        return hmac.compare_digest(presented.strip(), self._token)

    def current(self) -> tuple[bytes, tuple[int, int]]:
        """The token the file holds now (the last one read while the file is briefly gone), and the file's
        (mtime ns, size) when it was read: a file with another stamp may hold another token."""
        with contextlib.suppress(AuthTokenError):
            self._refresh()
        return self._token, self._stamp

    def _refresh(self) -> None:
        try:
            status = os.stat(self.path)
            stamp = (status.st_mtime_ns, status.st_size)
            if stamp == self._stamp:
                return
            token = self.path.read_bytes().strip()
        except OSError as error:
            raise AuthTokenError(f"the auth token file {self.path} cannot be read: {error.strerror}") from error
        if not token:
            raise AuthTokenError(f"the auth token file {self.path} is empty: put the bearer token in it")
        self._stamp, self._token = stamp, token
