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
from pathlib import Path

SCHEME = "bearer"


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
