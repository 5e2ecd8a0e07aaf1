"""What one server process lets a client hold of it, defined once: the Python servers read these values and the C
front is given them (`Limits.for_front`), so no limit is written twice.

Every buffer a client can fill is bounded three ways: per request (a message or body: beyond it the request is
refused, 413 / RESOURCE_EXHAUSTED), per connection and per process (buffered request bytes: beyond them the client's
data is not read or acknowledged, so flow control stops it, then its request is refused, never a growth). Every
connection is bounded in time: its request's head and body must arrive within their timeouts, and a connection with
nothing in flight is closed after `idle_timeout_s`. Floods of frames that cost the server work and the client
nothing (stream resets, CONTINUATION frames, PINGs and SETTINGS whose acknowledgements the client does not read) end
the connection with GOAWAY ENHANCE_YOUR_CALM.

The defaults follow the field: grpc's 4 MiB message (raised to hold a full batch of the model's input, as the HTTP
body limit is) and its 100 concurrent streams per connection; libnghttp2's own flood limits (1000 resets at once,
then 33 a second; 8 CONTINUATION frames to a header block; 1000 acknowledgements owed); a minute of idleness, as
most load balancers keep (`tandem serve --idle-timeout`, the pool's `idleTimeoutSeconds`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 4 * MIB
    """A gRPC request message at most (the model's full batch raises it: `for_batch`)."""
    max_body_bytes: int = 1 * MIB
    """An HTTP request body at most, once decoded (the model's full batch as JSON raises it: `for_batch`)."""
    max_head_bytes: int = 16 << 10
    """An HTTP/1.1 request head, or an HTTP/2 header list once decoded."""
    max_streams: int = 100
    """gRPC calls open at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS); further ones are refused."""
    stream_window_bytes: int = 1 * MIB
    """What a client may send on one stream before the server acknowledges it (SETTINGS_INITIAL_WINDOW_SIZE)."""
    connection_window_bytes: int = 16 * MIB
    """What a client may send on one connection, all streams together, before the server acknowledges it."""
    connection_buffer_bytes: int = 64 * MIB
    """Request bytes received and not yet served, one connection at most."""
    process_buffer_bytes: int = 512 * MIB
    """Request bytes received and not yet served, every connection of the process together."""
    unsent_bytes: int = 4 * MIB
    """Answers written and not yet read by the client, per connection: beyond it none of its requests is read."""
    header_timeout_s: float = 10.0
    """A request's head (HTTP/1.1) or header block (HTTP/2) must arrive within this of its first byte."""
    body_timeout_s: float = 60.0
    """A request's body must arrive within this of its head."""
    idle_timeout_s: float = 60.0
    """A connection with no request in flight is closed after this long (HTTP/2: with GOAWAY)."""
    reset_burst: int = 1000
    """Stream resets taken at once before their rate counts (libnghttp2's rapid-reset mitigation)."""
    resets_per_second: int = 33
    """Stream resets taken a second past the burst; beyond: GOAWAY ENHANCE_YOUR_CALM."""
    max_continuations: int = 8
    """CONTINUATION frames to one header block."""
    max_owed_acks: int = 1000
    """PING and SETTINGS acknowledgements a client may leave unread before its connection ends."""
    max_settings: int = 32
    """Settings in one SETTINGS frame."""

    def with_idle_timeout(self, seconds: float) -> Limits:
        """These limits with connections idle for `seconds` closed, and no head or body awaited longer either: no
        connection waits on its client longer than the idle timeout for anything."""
        return dataclasses.replace(self, idle_timeout_s=seconds, header_timeout_s=min(self.header_timeout_s, seconds),
                                   body_timeout_s=min(self.body_timeout_s, seconds))

    def for_batch(self, message_bytes: int, body_bytes: int) -> Limits:
        """These limits raised to hold a full batch: a gRPC message of `message_bytes`, an HTTP body of
        `body_bytes` (never lowered)."""
        return dataclasses.replace(self, max_message_bytes=max(self.max_message_bytes, message_bytes),
                                   max_body_bytes=max(self.max_body_bytes, body_bytes))

    def for_front(self) -> dict[str, int | float]:
        """The values as the C front takes them (keyword arguments of `_front.Front.configure`)."""
        return dataclasses.asdict(self)
