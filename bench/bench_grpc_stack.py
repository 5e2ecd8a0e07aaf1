"""Which gRPC stack should carry the inference server's gRPC service? The same tiny ModelInfer handler (decode a
ModelInferRequest holding 64 raw FP32 values, answer a ModelInferResponse holding 10) on each candidate, each in its
own process, driven by the same load generator (h2load: C, one thread, 8 connections and the rest of the
concurrency as streams on them, posting a pre-serialised request as bench_inference.py does) at 8, 64 and 256
concurrent calls. No model: this isolates the stack's own per-call cost. Prints each stack's calls/s and the server
process's CPU time per call (all its threads), and the ratios to grpc.aio as the server ran it before (the
generated servicer).

    flock /tmp/bench.lock .venv/bin/python bench/bench_grpc_stack.py [--seconds 4]

Candidates: grpc.aio with the generated servicer's (de)serialisers (what the server ran before); grpc.aio with a
generic handler on bytes; grpclib (pure Python, on h2) on uvloop; a minimal gRPC server straight over h2 on an asyncio
Protocol on uvloop; tandem.worker.serve.grpc_server (since issue 35 grpc.aio with its generic handler and the
Limits' options, on uvloop: what the server runs where the C front does not own the gRPC port; before, HTTP/2 framed
by hand).
Needs h2load (Debian: apt-get install nghttp2-client), and grpclib and h2 for their rows (pip install grpclib==0.4.9
h2==4.4.1; --stacks to leave them out).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tritonclient.grpc import service_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http_stack import free_port  # noqa: E402
from serve_costs import candidate_server, cpu_per_call, process_cpu  # noqa: E402

STACKS = ("grpc.aio servicer", "grpc.aio generic bytes", "grpclib+uvloop", "h2 protocol+uvloop",
          "tandem grpc_server")
BASELINE = STACKS[0]
NEEDS = {"grpclib+uvloop": "grpclib", "h2 protocol+uvloop": "h2"}  # packages outside the project's dependencies
CONCURRENCY = (8, 64, 256)
CONNECTIONS = 8
METHOD = "/inference.GRPCInferenceService/ModelInfer"
HOST = "127.0.0.1"


def request_bytes() -> bytes:
    request = service_pb2.ModelInferRequest(model_name="m",
                                            raw_input_contents=[np.full(64, 0.5, np.float32).tobytes()])
    request.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    return request.SerializeToString()


def answer(request: service_pb2.ModelInferRequest) -> service_pb2.ModelInferResponse:
    x = np.frombuffer(request.raw_input_contents[0], dtype=np.float32)
    response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
    response.outputs.add(name="output", datatype="FP32", shape=[1, 10])
    response.raw_output_contents.append(np.full(10, x.sum(), np.float32).tobytes())
    return response


def serve(stack: str, port: int) -> None:
    if stack.startswith("grpc.aio"):
        asyncio.run(_serve_grpc_aio(stack, port))
        return
    import uvloop

    runner = {"grpclib+uvloop": _serve_grpclib, "h2 protocol+uvloop": _serve_h2,
              "tandem grpc_server": _serve_tandem}[stack]
    uvloop.run(runner(port))


async def _serve_grpc_aio(stack: str, port: int) -> None:
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    if stack == "grpc.aio servicer":
        class Service(service_pb2_grpc.GRPCInferenceServiceServicer):
            async def ModelInfer(self, request, context):  # noqa: N802
                return answer(request)

        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Service(), server)
    else:
        async def infer(body: bytes, context) -> bytes:
            return answer(service_pb2.ModelInferRequest.FromString(body)).SerializeToString()

        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService", {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)})])
    server.add_insecure_port(f"{HOST}:{port}")
    await server.start()
    await server.wait_for_termination()


async def _serve_grpclib(port: int) -> None:
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server

    class Service:
        async def infer(self, stream) -> None:
            await stream.send_message(answer(await stream.recv_message()))

        def __mapping__(self):
            return {METHOD: Handler(self.infer, Cardinality.UNARY_UNARY, service_pb2.ModelInferRequest,
                                    service_pb2.ModelInferResponse)}

    server = Server([Service()])
    await server.start(HOST, port)
    await server.wait_closed()


async def _serve_h2(port: int) -> None:
    import h2.config
    import h2.connection
    import h2.events

    config = h2.config.H2Configuration(client_side=False, header_encoding=None)
    response_headers = [(b":status", b"200"), (b"content-type", b"application/grpc")]
    trailers = [(b"grpc-status", b"0")]

    class Protocol(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport = transport
            self.connection = h2.connection.H2Connection(config)
            self.connection.initiate_connection()
            self.bodies: dict[int, bytearray] = {}
            transport.write(self.connection.data_to_send())

        def data_received(self, data: bytes) -> None:
            connection = self.connection
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.ConnectionTerminated):  # h2load's GOAWAY at the end of a run
                    self.transport.close()
                    return
                if isinstance(event, h2.events.RequestReceived):
                    self.bodies[event.stream_id] = bytearray()
                elif isinstance(event, h2.events.DataReceived):
                    self.bodies[event.stream_id] += event.data
                    connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    body = self.bodies.pop(event.stream_id)
                    request = service_pb2.ModelInferRequest.FromString(bytes(body[5:]))
                    message = answer(request).SerializeToString()
                    connection.send_headers(event.stream_id, response_headers)
                    connection.send_data(event.stream_id, b"\0" + len(message).to_bytes(4, "big") + message)
                    connection.send_headers(event.stream_id, trailers, end_stream=True)
            self.transport.write(connection.data_to_send())

    server = await asyncio.get_running_loop().create_server(Protocol, HOST, port)
    await server.serve_forever()


async def _serve_tandem(port: int) -> None:
    from tandem.worker.serve.grpc_server import GrpcServer
    from tandem.worker.serve.limits import Limits

    async def infer(request: service_pb2.ModelInferRequest, context) -> service_pb2.ModelInferResponse:
        return answer(request)

    limits = Limits(max_message_bytes=64 << 20)
    await GrpcServer({METHOD: (service_pb2.ModelInferRequest, infer)}, limits).start(HOST, port)
    await asyncio.Event().wait()


def wait_until_answering(port: int) -> None:
    """Block until one ModelInfer call through grpcio's client is answered right (h2load sees only HTTP statuses)."""
    import grpc

    deadline = time.monotonic() + 60
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        infer = channel.unary_unary(METHOD, request_serializer=None,
                                    response_deserializer=service_pb2.ModelInferResponse.FromString)
        while True:
            try:
                response = infer(request_bytes(), timeout=5)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    if np.frombuffer(response.raw_output_contents[0], np.float32).tolist() != [32.0] * 10:
        raise AssertionError(f"wrong answer: {response}")


def h2load(port: int, request_file: Path, concurrency: int, seconds: float) -> tuple[int, float]:
    """Calls answered with HTTP 200 over `seconds`, and the rate h2load reports."""
    connections = min(concurrency, CONNECTIONS)
    out = subprocess.run(["h2load", "-t1", f"-c{connections}", f"-m{concurrency // connections}", "-d",
                          str(request_file), "-H", "content-type: application/grpc", "-H", "te: trailers",
                          "-D", str(max(1, round(seconds))), f"http://{HOST}:{port}{METHOD}"],
                         check=True, capture_output=True, text=True).stdout
    rate = float(re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out).group(1))
    succeeded = int(re.search(r"status codes: (\d+) 2xx", out).group(1))
    return succeeded, rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--serve", choices=STACKS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--stacks", nargs="+", choices=STACKS, default=list(STACKS))
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    stacks = [stack for stack in args.stacks if importlib.util.find_spec(NEEDS.get(stack, "grpc")) is not None]
    for stack in set(args.stacks) - set(stacks):
        print(f"{stack}: skipped: {NEEDS[stack]} is not installed (pip install {NEEDS[stack]})")
    rates, cpu = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        request_file = Path(tmp) / "request.grpc"
        message = request_bytes()
        request_file.write_bytes(b"\0" + len(message).to_bytes(4, "big") + message)
        for stack in stacks:
            port = free_port()
            with candidate_server(__file__, stack, port) as server:
                wait_until_answering(port)
                h2load(port, request_file, CONCURRENCY[0], 1)  # warm-up
                for concurrency in CONCURRENCY:
                    before = process_cpu(server.pid)
                    calls, rate = h2load(port, request_file, concurrency, args.seconds)
                    cpu[stack, concurrency] = cpu_per_call(server.pid, before, calls)
                    rates[stack, concurrency] = rate
                    print(f"{stack:24s} c={concurrency:<3d} {rate:8.0f} calls/s  server CPU "
                          f"{cpu[stack, concurrency]:.0f} us/call", flush=True)
    if BASELINE not in stacks:
        return
    print(f"\n| stack | {' | '.join(f'c={c}: calls/s (CPU us/call)' for c in CONCURRENCY)} | "
          f"CPU per call / {BASELINE}'s | calls/s / {BASELINE}'s |")
    print("|---|" + "---|" * (len(CONCURRENCY) + 2))
    for stack in stacks:
        cells = " | ".join(f"{rates[stack, c]:.0f} ({cpu[stack, c]:.0f})" for c in CONCURRENCY)
        cpu_ratio = " / ".join(f"{cpu[stack, c] / cpu[BASELINE, c]:.2f}" for c in CONCURRENCY)
        rate_ratio = " / ".join(f"{rates[stack, c] / rates[BASELINE, c]:.2f}" for c in CONCURRENCY)
        print(f"| {stack} | {cells} | {cpu_ratio} | {rate_ratio} |")


if __name__ == "__main__":
    main()
