"""Which HTTP stack should carry the inference server? The same tiny Open-Inference-shaped handler (parse a
JSON body with orjson, turn 64 numbers into a numpy array, answer 10 numbers) on aiohttp (asyncio loop),
aiohttp on uvloop, starlette on uvicorn (httptools + uvloop), and tandem.worker.serve.http (an asyncio
protocol over httptools, on uvloop: what the server uses), each in its own process, driven by the same load
generator at concurrency 8 and 64. No model: this isolates the stack's own per-request cost. Prints each
stack's requests/s and the server process's CPU time per request, and the ratios to aiohttp.

    .venv/bin/python bench/bench_http_stack.py [--seconds 4]

Needs the `bench` extra (uvicorn and starlette come with litserve).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import build_request, load, wait_for_port  # noqa: E402
from serve_costs import candidate_server, cpu_per_call, process_cpu  # noqa: E402

STACKS = ("aiohttp", "aiohttp+uvloop", "starlette+uvicorn", "tandem httpserver")
BODY = orjson.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]})


def _answer(body: bytes) -> bytes:
    request = orjson.loads(body)
    x = np.asarray(request["inputs"][0]["data"], dtype=np.float32)
    out = np.full(10, float(x.sum()), dtype=np.float32)
    return orjson.dumps({"outputs": [{"name": "output", "shape": [1, 10], "datatype": "FP32", "data": out}]},
                        option=orjson.OPT_SERIALIZE_NUMPY)


def serve(stack: str, port: int) -> None:
    if stack == "tandem httpserver":
        import uvloop

        from tandem.worker.serve.http import HttpServer

        def handle(request) -> None:
            if request.path == "/v2/health/ready":
                request.respond(200, b'{"ready":true}')
            else:
                request.respond(200, _answer(request.body))

        async def run() -> None:
            await HttpServer(handle, lambda: 1 << 20).start("127.0.0.1", port)
            await asyncio.Event().wait()

        uvloop.run(run())
    elif stack.startswith("aiohttp"):
        from aiohttp import web

        async def infer(request: web.Request) -> web.Response:
            return web.Response(body=_answer(await request.read()), content_type="application/json")

        async def ready(request: web.Request) -> web.Response:
            return web.Response(body=b'{"ready":true}', content_type="application/json")

        app = web.Application()
        app.router.add_post("/v2/models/m/infer", infer)
        app.router.add_get("/v2/health/ready", ready)
        loop = None
        if stack == "aiohttp+uvloop":
            import uvloop

            loop = uvloop.new_event_loop()
        web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, loop=loop)
    else:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        async def infer(request):
            return Response(_answer(await request.body()), media_type="application/json")

        async def ready(request):
            return Response(b'{"ready":true}', media_type="application/json")

        app = Starlette(routes=[Route("/v2/models/m/infer", infer, methods=["POST"]),
                                Route("/v2/health/ready", ready)])
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                    loop="uvloop", http="httptools")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--serve", choices=STACKS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    results, cpu = {}, {}
    for stack in STACKS:
        port = free_port()
        with candidate_server(__file__, stack, port) as server:
            asyncio.run(wait_for_port("127.0.0.1", port))
            request = build_request("127.0.0.1", port, "/v2/models/m/infer", BODY)
            for concurrency in (8, 64):
                before = process_cpu(server.pid)
                result = load("127.0.0.1", port, request, concurrency=concurrency, seconds=args.seconds, warmup=0)
                cpu[stack, concurrency] = cpu_per_call(server.pid, before, result.requests)
                results[stack, concurrency] = result
                print(f"{stack:18s} c={concurrency:<3d} {result.line()}  server CPU "
                      f"{cpu[stack, concurrency]:.0f} us/request", flush=True)
    for concurrency in (8, 64):
        base = results["aiohttp", concurrency].rps
        ratios = ", ".join(f"{stack} {results[stack, concurrency].rps / base:.2f}" for stack in STACKS)
        print(f"c={concurrency}: throughput relative to aiohttp: {ratios}")
        base = cpu["aiohttp", concurrency]
        ratios = ", ".join(f"{stack} {cpu[stack, concurrency] / base:.2f}" for stack in STACKS)
        print(f"c={concurrency}: server CPU per request relative to aiohttp: {ratios}")


if __name__ == "__main__":
    main()
