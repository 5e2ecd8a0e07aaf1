"""The gRPC server's wire (worker/serve/grpc_server.py) without a socket: HPACK fields, grpc-message's encoding,
grpc-timeout, unary bodies, SETTINGS and padding."""

from __future__ import annotations

import gzip
import zlib
from types import SimpleNamespace

import grpc
import hpack
import pytest
from tritonclient.grpc import service_pb2

from tandem.worker.serve.grpc_server import (
    COMPRESSION_ERROR,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    PADDED,
    PROTOCOL_ERROR,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE,
    ConnectionFailure,
    GrpcError,
    HeaderDecoder,
    header_field,
    parse_settings,
    parse_timeout,
    percent_encode,
    status_block,
    unary_message,
    unpad,
)
from tandem.worker.serve.grpc_service import GrpcService


@pytest.mark.parametrize(("name", "value"), [
    (b"grpc-status", b"0"),
    (b"grpc-message", b"x" * 126),  # the longest length in the string's 7-bit prefix
    (b"grpc-message", b"x" * 127),  # the first that continues into a second byte
    (b"grpc-message", b"y" * 70_000),  # three bytes of length
])
def test_header_fields_decode_as_written_and_leave_the_table_empty(name, value):
    decoder = hpack.Decoder()
    decoder.max_header_list_size = 1 << 20
    assert decoder.decode(header_field(name, value) * 2, raw=True) == [(name, value), (name, value)]
    assert len(decoder.header_table.dynamic_entries) == 0


def test_a_status_block_carries_the_code_number_and_the_encoded_message():
    fields = hpack.Decoder().decode(status_block(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full: 100%"), raw=True)
    assert fields == [(b"grpc-status", b"8"), (b"grpc-message", b"queue full: 100%25")]


@pytest.mark.parametrize(("message", "encoded"), [
    ("plain words, (and) punctuation!", b"plain words, (and) punctuation!"),
    ("100%", b"100%25"),
    ("na\u00efve", b"na%C3%AFve"),
    ("two\nlines\t", b"two%0Alines%09"),
    ("", b""),
])
def test_grpc_message_is_percent_encoded_utf8(message, encoded):
    assert percent_encode(message) == encoded


@pytest.mark.parametrize(("header", "seconds"), [
    ("200m", 0.2), ("1S", 1.0), ("3H", 10800.0), ("2M", 120.0), ("5u", 5e-6), ("7n", 7e-9), ("99999999S", 99999999.0),
])
def test_grpc_timeout_in_seconds(header, seconds):
    assert parse_timeout(header) == pytest.approx(seconds)


@pytest.mark.parametrize("header", ["", "1", "S", "123456789S", "1x", "-1S", "1.5S", " 1S"])
def test_a_malformed_grpc_timeout_is_invalid_argument_naming_the_form(header):
    with pytest.raises(GrpcError) as refused:
        parse_timeout(header)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert f"grpc-timeout {header!r} is not a timeout" in refused.value.message and "200m" in refused.value.message


@pytest.mark.parametrize(("body", "message"), [
    (b"\0\0\0\0\3abc", b"abc"),
    (b"\0\0\0\0\0", b""),
])
def test_a_unary_body_holds_one_message(body, message):
    assert unary_message(bytearray(body), None, 100) == message


def _compressed(message: bytes, compress) -> bytes:
    packed = compress(message)
    return b"\1" + len(packed).to_bytes(4, "big") + packed


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compressed_message_is_decompressed(encoding):
    compress = gzip.compress if encoding == "gzip" else zlib.compress
    assert unary_message(_compressed(b"abc" * 30, compress), encoding, 100) == b"abc" * 30


@pytest.mark.parametrize(("body", "code", "words"), [
    (b"", grpc.StatusCode.INVALID_ARGUMENT, "no request message"),
    (b"\0\0\0", grpc.StatusCode.INVALID_ARGUMENT, "no request message"),
    (b"\1\0\0\0\3abc", grpc.StatusCode.INVALID_ARGUMENT, "the gzip request message cannot be decompressed"),
    (b"\2\0\0\0\3abc", grpc.StatusCode.INVALID_ARGUMENT, "compressed flag is 2"),
    (_compressed(b"0" * 101, gzip.compress), grpc.StatusCode.RESOURCE_EXHAUSTED, "over 100 bytes once decompressed"),
    (b"\0\0\0\0\5abc", grpc.StatusCode.INVALID_ARGUMENT, "cut short: 3 of the 5 bytes"),
    (b"\0\0\0\0\1a\0\0\0\0\1b", grpc.StatusCode.UNIMPLEMENTED, "more than one request message"),
])
def test_a_body_that_is_not_one_message_is_refused(body, code, words):
    with pytest.raises(GrpcError) as refused:
        unary_message(body, "gzip", 100)
    assert refused.value.code is code and words in refused.value.message


@pytest.mark.parametrize(("encoding", "code", "words"), [
    (None, grpc.StatusCode.INVALID_ARGUMENT, "needs grpc-encoding gzip or deflate"),
    ("identity", grpc.StatusCode.INVALID_ARGUMENT, "needs grpc-encoding gzip or deflate"),
    ("snappy", grpc.StatusCode.UNIMPLEMENTED, "'snappy', which is not supported; use gzip, deflate or none"),
])
def test_a_compressed_message_needs_an_encoding_the_server_knows(encoding, code, words):
    with pytest.raises(GrpcError) as refused:
        unary_message(_compressed(b"abc", gzip.compress), encoding, 100)
    assert refused.value.code is code and words in refused.value.message


def _setting(identifier: int, value: int) -> bytes:
    return identifier.to_bytes(2, "big") + value.to_bytes(4, "big")


def test_settings_by_identifier():
    payload = _setting(SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20) + _setting(SETTINGS_MAX_FRAME_SIZE, 1 << 16) + \
        _setting(0x99, 7)
    assert parse_settings(payload) == {SETTINGS_INITIAL_WINDOW_SIZE: 1 << 20, SETTINGS_MAX_FRAME_SIZE: 1 << 16,
                                       0x99: 7}
    assert parse_settings(b"") == {}


@pytest.mark.parametrize(("payload", "code"), [
    (b"\0\4\0\0", FRAME_SIZE_ERROR),
    (_setting(SETTINGS_INITIAL_WINDOW_SIZE, 1 << 31), FLOW_CONTROL_ERROR),
    (_setting(SETTINGS_MAX_FRAME_SIZE, 16383), PROTOCOL_ERROR),
    (_setting(SETTINGS_MAX_FRAME_SIZE, 1 << 24), PROTOCOL_ERROR),
])
def test_settings_out_of_bounds_end_the_connection(payload, code):
    with pytest.raises(ConnectionFailure) as failed:
        parse_settings(payload)
    assert failed.value.code == code


@pytest.mark.parametrize(("payload", "flags", "data"), [
    (b"abc", 0, b"abc"),
    (b"\2abcxx", PADDED, b"abc"),
    (b"\0abc", PADDED, b"abc"),
    (b"\3abc", PADDED, b""),
])
def test_padding_is_taken_off(payload, flags, data):
    assert unpad(payload, flags) == data


@pytest.mark.parametrize("payload", [b"", b"\4abc", b"\x09ab"])
def test_padding_longer_than_the_frame_ends_the_connection(payload):
    with pytest.raises(ConnectionFailure) as failed:
        unpad(payload, PADDED)
    assert failed.value.code == PROTOCOL_ERROR


def test_a_header_block_that_leaves_the_table_as_it_was_is_remembered_until_the_table_changes():
    encoder, decoder = hpack.Encoder(), HeaderDecoder()
    adds_x = encoder.encode([(b"x-call", b"first")], huffman=False)  # a literal with incremental indexing
    refers = encoder.encode([(b"x-call", b"first")], huffman=False)  # now an index into the dynamic table
    assert refers != adds_x
    assert decoder.decode(adds_x) == {"x-call": "first"} and decoder.known == {}, "changed the table: not kept"
    assert decoder.decode(refers) == {"x-call": "first"} and refers in decoder.known
    assert decoder.decode(refers) is decoder.known[refers]
    adds_y = encoder.encode([(b"x-call", b"second")], huffman=False)
    assert decoder.decode(adds_y) == {"x-call": "second"} and decoder.known == {}, "the table changed: all forgotten"
    assert decoder.decode(refers) == {"x-call": "second"}, "the same index now names the newer entry"


def test_a_block_hpack_cannot_decode_ends_the_connection():
    with pytest.raises(ConnectionFailure) as failed:
        HeaderDecoder().decode(b"\xff\xff\xff\xff\xff")
    assert failed.value.code == COMPRESSION_ERROR and "HPACK cannot decode" in str(failed.value)


def test_remembered_blocks_are_bounded():
    decoder = HeaderDecoder(remember=2)
    blocks = [header_field(b":path", f"/{n}".encode()) for n in range(3)]  # literals that leave the table be
    assert [decoder.decode(block) for block in blocks] == [{":path": f"/{n}"} for n in range(3)]
    assert list(decoder.known) == blocks[:2]


def test_the_service_serves_each_rpc_of_the_proto_it_implements_with_its_request_type():
    service = GrpcService(SimpleNamespace(routes=None), None)
    methods = service.methods()
    prefix = "/inference.GRPCInferenceService/"
    assert sorted(methods) == [prefix + name for name in (
        "ModelConfig", "ModelInfer", "ModelMetadata", "ModelReady", "ModelStatistics", "RepositoryIndex",
        "RepositoryModelLoad", "RepositoryModelUnload", "ServerLive", "ServerMetadata", "ServerReady")]
    for path, (request_type, handler) in methods.items():
        name = path.removeprefix(prefix)
        assert request_type is getattr(service_pb2, f"{name}Request") and handler == getattr(service, name)
