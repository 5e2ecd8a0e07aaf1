"""Compressed request bodies, HTTP's Content-Encoding and gRPC's grpc-encoding alike: gzip and deflate, inflated to at
most a limit (a small bomb is refused without inflating it whole)."""

from __future__ import annotations

import zlib


class DecompressError(ValueError):
    """A compressed body that cannot be taken, with the HTTP status that says why: 415 (an encoding other than gzip
    and deflate), 400 (data that does not decompress) or 413 (larger than the limit once decompressed)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def decompress(body: bytes, encoding: str, limit: int, what: str = "request body") -> bytes:
    """`body` compressed with `encoding` (gzip or deflate: HTTP's Content-Encoding, gRPC's grpc-encoding), at most
    `limit` bytes once decompressed (a small bomb is refused without inflating it whole); `what` names it in errors."""
    encoding = encoding.strip().lower()
    if encoding == "gzip":
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif encoding == "deflate":
        decoder = zlib.decompressobj()
    else:
        raise DecompressError(f"{what} compressed with {encoding!r}, which is not supported; use gzip, deflate or "
                              "none (identity)", 415)
    try:
        data = decoder.decompress(body, limit + 1)
    except zlib.error as error:
        raise DecompressError(f"the {encoding} {what} cannot be decompressed: {error}", 400) from None
    if len(data) > limit:
        raise DecompressError(f"{what} too large: over {limit} bytes once decompressed", 413)
    return data
