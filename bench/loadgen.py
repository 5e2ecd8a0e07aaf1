"""A lean HTTP/1.1 load generator for the benchmarks: N keep-alive connections, each sending one request
after another (closed loop), recording per-request latency.

Every server under comparison is driven by this same client, so its own cost (it shares the CPUs with the
server) weighs the same on every side of a ratio. It sends pre-encoded bytes and parses only the status line
and Content-Length, which keeps it far cheaper than aiohttp's or tritonclient's clients.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


@dataclass
class LoadResult:
    requests: int
    seconds: float
    latencies_ms: list[float] = field(repr=False)
    statuses: dict[int, int]

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    @property
    def p50(self) -> float:
        return self.percentile(50)

    @property
    def p99(self) -> float:
        return self.percentile(99)

    def line(self) -> str:
        failed = sum(n for status, n in self.statuses.items() if status != 200)
        return f"{self.rps:8.0f} req/s  p50 {self.p50:7.2f} ms  p99 {self.p99:7.2f} ms  non-200: {failed}"


def build_request(host: str, port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
            break
    if length is None:
        raise RuntimeError(f"response without Content-Length: {head[:200]!r}")
    return status, await reader.readexactly(length)


async def _connection(host, port, request, stop_at, warm_until, latencies, statuses, check):
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while True:
            started = time.perf_counter()
            if started >= stop_at:
                return
            writer.write(request)
            status, body = await _read_response(reader)
            finished = time.perf_counter()
            if started >= warm_until:
                latencies.append((finished - started) * 1000.0)
                statuses[status] = statuses.get(status, 0) + 1
            if check is not None and status == 200:
                check(body)
    finally:
        writer.close()


async def run_load(
    host: str, port: int, request: bytes, *, concurrency: int, seconds: float, warmup: float = 0.5, check=None
) -> LoadResult:
    """Drive `request` (raw bytes from build_request) with `concurrency` connections for `seconds` (after
    `warmup` seconds whose requests are not counted)."""
    warm_until = time.perf_counter() + warmup
    stop_at = warm_until + seconds
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    await asyncio.gather(*(
        _connection(host, port, request, stop_at, warm_until, latencies, statuses, check) for _ in range(concurrency)
    ))
    return LoadResult(len(latencies), seconds, latencies, statuses)


def load(host: str, port: int, request: bytes, **kwargs) -> LoadResult:
    """run_load on a fresh event loop (uvloop when installed)."""
    try:
        import uvloop

        return uvloop.run(run_load(host, port, request, **kwargs))
    except ImportError:
        return asyncio.run(run_load(host, port, request, **kwargs))


async def wait_for_port(host: str, port: int, path: str = "/v2/health/ready", timeout: float = 60.0) -> None:
    """Until GET `path` answers 200 (servers started as subprocesses)."""
    deadline = time.monotonic() + timeout
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(request)
            status, _ = await _read_response(reader)
            writer.close()
            if status == 200:
                return
        except (OSError, asyncio.IncompleteReadError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing answered 200 on http://{host}:{port}{path} within {timeout}s")
        await asyncio.sleep(0.1)
