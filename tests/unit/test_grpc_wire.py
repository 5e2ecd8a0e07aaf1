"""The gRPC server's own parts (worker/serve/grpc_server.py) without a socket: grpc-timeout, unary bodies, the calls
the C front hands over (start_call, outcome), grpc.aio's options from the Limits, and the service's methods table."""

from __future__ import annotations

import asyncio
import gzip
import zlib
from functools import partial
from types import SimpleNamespace

import grpc
import pytest
from tritonclient.grpc import service_pb2

from tandem.api.inference import InferencePoolSpec
from tandem.worker.serve.grpc_server import (
    GrpcError,
    GrpcServer,
    parse_timeout,
    server_options,
    unary_message,
)
from tandem.worker.serve.grpc_service import GrpcService
from tandem.worker.serve.limits import Limits


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
    (_compressed(b"0" * 101, partial(gzip.compress, mtime=0)), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "over 100 bytes once decompressed"),  # mtime 0: the same bytes, so the same test id, on every pytest worker
    (b"\0\0\0\0\5abc", grpc.StatusCode.INVALID_ARGUMENT, "cut short: 3 of the 5 bytes"),
    (b"\0\0\0\0\x65" + b"x" * 101, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max (101 vs. 100)"),
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


async def _answer(request, context):
    return service_pb2.ServerLiveResponse(live=context.time_remaining() is None)


LIVE = "/inference.GRPCInferenceService/ServerLive"
HEADERS = {":path": LIVE, "content-type": "application/grpc"}


def _start(headers: dict[str, str], body: bytes = b"\0\0\0\0\0"):
    async def start():
        server = GrpcServer({LIVE: (service_pb2.ServerLiveRequest, _answer)}, Limits(max_message_bytes=100))
        call = server.start_call(headers, body, asyncio.get_running_loop())
        return server, (call if call is None else await call)
    return asyncio.run(start())


def test_a_call_handed_over_is_started_and_its_outcome_is_code_message_and_data():
    server, answer = _start(HEADERS)
    assert answer == service_pb2.ServerLiveResponse(live=True)
    data = answer.SerializeToString()
    assert server.outcome(answer, None) == (0, "", b"\0" + len(data).to_bytes(4, "big") + data)
    assert server.outcome(None, GrpcError(grpc.StatusCode.UNAVAILABLE, "100% gone")) == (14, "100% gone", None)
    assert server.outcome(None, KeyError("x")) == (13, "internal error: KeyError", None)
    assert server.outcome(service_pb2.ModelInferResponse(raw_output_contents=[b"x" * 200]), None)[:2] == \
        (8, "Sent message larger than max (203 vs. 100)")


def test_a_request_that_is_not_grpcs_is_left_to_the_front():
    assert _start({":path": LIVE, "content-type": "application/json"})[1] is None


@pytest.mark.parametrize(("headers", "code", "words"), [
    ({**HEADERS, "grpc-timeout": "0n"}, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
    ({**HEADERS, "grpc-timeout": "0S"}, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
    ({**HEADERS, ":path": "/x/Y"}, grpc.StatusCode.UNIMPLEMENTED, "unknown method '/x/Y'"),
    ({**HEADERS, "grpc-timeout": "soon"}, grpc.StatusCode.INVALID_ARGUMENT, "is not a timeout"),
])
def test_a_call_refused_before_its_handler_runs(headers, code, words):
    with pytest.raises(GrpcError) as refused:
        _start(headers)
    assert refused.value.code is code and words in refused.value.message


def test_grpc_aios_options_are_the_limits():
    limits = Limits(max_message_bytes=5 << 20, max_streams=7, max_head_bytes=9000, idle_timeout_s=1.5,
                    header_timeout_s=2.0, stream_window_bytes=1 << 18)
    options = dict(server_options(limits))
    assert (options["grpc.max_receive_message_length"], options["grpc.max_send_message_length"]) == (5 << 20,) * 2
    assert (options["grpc.max_concurrent_streams"], options["grpc.max_metadata_size"]) == (7, 9000)
    assert (options["grpc.max_connection_idle_ms"], options["grpc.server_handshake_timeout_ms"]) == (1500, 2000)
    assert (options["grpc.http2.lookahead_bytes"], options["grpc.http2.bdp_probe"]) == (1 << 18, 0)


def test_the_pools_idle_timeout_defaults_to_the_limits():
    assert InferencePoolSpec.model_fields["idle_timeout_seconds"].default == Limits().idle_timeout_s
