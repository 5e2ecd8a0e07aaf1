"""HTTP/2 frames written byte by byte, for tests that must send what no well-behaved client library sends (floods,
breaches of the protocol, streams held open): the product frames nothing by hand; its tests attack it with these.
Header blocks are HPACK literals without indexing and without Huffman coding (RFC 7541 6.2.2), which any decoder
reads and which leave its dynamic table as it was."""

from __future__ import annotations

import socket
import struct

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 0x7, 0x8, 0xB


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def _integer(value: int, prefix_bits: int = 7) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out, value = [limit], value - limit
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes((*out, value))


def header_block(headers: list[tuple[str, str]]) -> bytes:
    return b"".join(b"\0" + _integer(len(name)) + name.encode() + _integer(len(value)) + value.encode()
                    for name, value in headers)


def grpc_headers(path: str = "/inference.GRPCInferenceService/ServerLive", **extra: str) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"),
            ("content-type", "application/grpc"), ("te", "trailers"), *extra.items()]


def grpc_message(message: bytes) -> bytes:
    """A gRPC body: the message, length-prefixed, uncompressed."""
    return b"\0" + len(message).to_bytes(4, "big") + message


def hello() -> bytes:
    """The client's preface and an empty SETTINGS frame."""
    return PREFACE + frame(SETTINGS, 0, 0)


def settings_ack() -> bytes:
    return frame(SETTINGS, ACK, 0)


def rst_stream(stream: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, stream, code.to_bytes(4, "big"))


def frames_in(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """The whole frames in `data`: (kind, flags, stream, payload) each."""
    frames, offset = [], 0
    while len(data) - offset >= 9:
        length = int.from_bytes(data[offset:offset + 3], "big")
        if len(data) - offset < 9 + length:
            break
        kind, flags = data[offset + 3], data[offset + 4]
        stream = struct.unpack(">I", data[offset + 5:offset + 9])[0] & 0x7FFFFFFF
        frames.append((kind, flags, stream, data[offset + 9:offset + 9 + length]))
        offset += 9 + length
    return frames


def goaway_code(data: bytes) -> int | None:
    """The error code of the first GOAWAY among the frames in `data` (None: there is none)."""
    for kind, _, _, payload in frames_in(data):
        if kind == GOAWAY:
            return int.from_bytes(payload[4:8], "big")
    return None


def read_until_closed(sock: socket.socket, limit: int = 64 << 20) -> bytes:
    """What the server sends until it closes the connection (a reset counts as closed); at most `limit` bytes are
    kept (the rest is read and dropped). The socket's timeout bounds the wait: socket.timeout if it stays open."""
    received = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            return bytes(received)
        if not chunk:
            return bytes(received)
        if len(received) < limit:
            received += chunk


def answer_headers(sock: socket.socket, stream: int) -> dict[str, str]:
    """The headers and trailers the server answers on `stream` with, merged (its header blocks decoded with hpack's
    decoder, every block of the connection in order), once the stream ends; PINGs and SETTINGS are acknowledged."""
    decoder, received, headers = hpack.Decoder(), b"", {}
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError(f"closed before stream {stream} ended: {headers}")
        received += chunk
        done = 0
        for kind, flags, on, payload in frames_in(received):
            done += 9 + len(payload)
            if kind == HEADERS:
                fields = dict(decoder.decode(payload))
                if on == stream:
                    headers.update(fields)
                    if flags & END_STREAM:
                        return headers
            elif kind == SETTINGS and not flags & ACK:
                sock.sendall(settings_ack())
            elif kind == DATA and on == stream and flags & END_STREAM:
                return headers
        received = received[done:]
