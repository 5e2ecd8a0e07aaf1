"""Helpers for the inference server tests: pools, checkpoints, reference outputs, raw HTTP, and the servers behind
the `served` fixture (tests/conftest.py)."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
import tritonclient.http as triton
from inference_models import GATES, seeded_mlp

from tandem.api.inference import InferencePool
from tandem.worker import checkpoint
from tandem.worker.serve.app import InferenceServer
from tandem.worker.serve.native import UNAVAILABLE

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
WAIT_S = 60.0
NO_C_FRONT = None if UNAVAILABLE is None else f"the C front is not built here: {UNAVAILABLE}"
"""Why the C front's tests skip, where they do."""
needs_c_front = pytest.mark.skipif(NO_C_FRONT is not None, reason=str(NO_C_FRONT))


def skip_without_c_front(http_front: str) -> None:
    """Skip a test run under `http_front` where that is the C front and it is not built here."""
    if http_front == "native" and NO_C_FRONT is not None:
        pytest.skip(NO_C_FRONT)


def make_pool(name: str = "digits", **spec) -> InferencePool:
    spec.setdefault("model", {"callable": "inference_models:seeded_mlp", "inputShape": [64]})
    if os.environ.get("TANDEM_TEST_HTTP_FRONT"):  # set by the http_front fixture (conftest.py)
        spec.setdefault("httpFront", os.environ["TANDEM_TEST_HTTP_FRONT"])
    return InferencePool.model_validate({
        "apiVersion": "tandem.dev/v1alpha1", "kind": "InferencePool", "metadata": {"name": name}, "spec": spec})


def gated_pool(name: str, **spec) -> InferencePool:
    GATES.pop(name, None)
    return make_pool(name, model={"callable": "inference_models:gated_mlp", "args": {"name": name}, "inputShape": [64]},
                     **spec)


def write_checkpoint(directory: Path, seed: int, step: int, hidden: int = 16, features: int = 64,
                     metrics: dict[str, float] | None = None) -> Path:
    """A trainer checkpoint of the digits MLP (through the trainer's own checkpoint module), with the evaluation
    `metrics` rank 0 records (none by default)."""
    model = seeded_mlp(seed, hidden) if features == 64 else torch.nn.Linear(features, 10)
    manifest = checkpoint.build_manifest(
        model="tandem.examples.digits:mlp" if features == 64 else "torch.nn:Linear",
        model_args={"hidden": hidden} if features == 64 else {"in_features": features, "out_features": 10},
        input_shape=[features], input_dtype="FP32", step=step, **({"metrics": metrics} if metrics else {}))
    return checkpoint.save(directory, {"manifest": manifest, "model": model.state_dict()}, step=step, keep_last=10)


def inputs(count: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random((count, 64), dtype=np.float32)


def reference(x: np.ndarray, seed: int = 0, hidden: int = 16) -> np.ndarray:
    with torch.no_grad():
        return seeded_mlp(seed, hidden)(torch.from_numpy(x)).numpy()


def infer(client: triton.InferenceServerClient, x: np.ndarray, binary: bool = True, model: str = "digits",
          **kwargs) -> np.ndarray:
    tensor = triton.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    output = triton.InferRequestedOutput("output", binary_data=binary)
    return client.infer(model, [tensor], outputs=[output], **kwargs).as_numpy("output")


def infer_in_thread(url: str, x: np.ndarray, model: str, binary: bool = True) -> np.ndarray:
    """A blocking tritonclient call with its own client, for a worker thread: tritonclient's async_infer runs on
    gevent and makes progress only while the calling thread waits in gevent, so requests that must be in flight
    while the test does something else are sent from threads."""
    client = triton.InferenceServerClient(url)
    try:
        return infer(client, x, binary=binary, model=model)
    finally:
        client.close()


def request(port: int, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None, timeout: float = WAIT_S) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def json_body(x: np.ndarray, **extra) -> bytes:
    return orjson.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                     "data": x.ravel().tolist()}], **extra})


def wait_until(condition, timeout: float = WAIT_S, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        time.sleep(0.01)


def fill_the_queue(name: str, inference, send: Callable[[int], np.ndarray]) -> tuple[ThreadPoolExecutor,
                                                                                    list[Future]]:
    """On gated_pool(name, workersPerReplica=1, batchLimit=1, queueLimit=4): request 0 held at the gate (running)
    and requests 1-4 queued, each `send(i)` on a thread of its own; the pool and the futures of their answers."""
    gate = GATES[name]
    pool = ThreadPoolExecutor(5)
    gate.close()
    accepted = []
    for i in range(5):
        accepted.append(pool.submit(send, i))
        if i == 0:
            gate.wait_entered(1)
    wait_until(lambda: inference.queued == 4, what="four queued requests")
    return pool, accepted


class Servers:
    """Starts servers (`servers(pool, checkpoint, **kwargs)`; `grpc=True`: the gRPC service too, on any free port)
    and stops them all on exit, gates opened first."""

    def __init__(self) -> None:
        self.started = []

    def __call__(self, pool: InferencePool, checkpoint_path: str | None = None, grpc: bool = False, **kwargs):
        background = InferenceServer(pool, checkpoint_path, **kwargs).start_in_thread(grpc_port=0 if grpc else None)
        self.started.append(background)
        return background

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for gate in GATES.values():
            gate.open.set()
        for background in self.started:
            background.stop()


def serve_process(manifest: Path, *args: str, command: str = "-m") -> subprocess.Popen:
    """`tandem serve MANIFEST --port 0 ARGS...` in a process (command "tandem": the console script, as the README
    runs it; "-m": python -m tandem.cli), with tests/ on PYTHONPATH for the test models; gRPC on any free port
    unless ARGS say otherwise (never the default 8001, which concurrent tests would share)."""
    if "--grpc-port" not in args and "--no-grpc" not in args:
        args = (*args, "--grpc-port", "0")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    script = Path(sys.executable).with_name("tandem")
    program = [str(script)] if command == "tandem" and script.exists() else [sys.executable, "-m", "tandem.cli"]
    return subprocess.Popen([*program, "serve", str(manifest), "--port", "0", *args], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, text=True)


def port_from_log(process: subprocess.Popen) -> int:
    """The port from `tandem serve`'s line `listening on http://127.0.0.1:PORT ...` (once the model is loaded)."""
    return ports_from_log(process)[0]


def ports_from_log(process: subprocess.Popen) -> tuple[int, int | None]:
    """The HTTP and gRPC ports from `tandem serve`'s line `listening on http://127.0.0.1:PORT and
    grpc://127.0.0.1:PORT ...` (None: no gRPC), written once the model is loaded; the lines before it are read."""
    return ports_in(listening_line(process))


def listening_line(process: subprocess.Popen) -> str:
    """`tandem serve`'s `listening on` line, once the model is loaded (the lines before it read and dropped)."""
    return log_until_listening(process)[-1]


def log_until_listening(process: subprocess.Popen) -> list[str]:
    """`tandem serve`'s log lines up to its `listening on` line (the last), written once the model is loaded."""
    lines = []
    while line := process.stderr.readline():
        lines.append(line)
        if "listening on http://127.0.0.1:" in line:
            return lines
    raise AssertionError(f"tandem serve ended without listening: {''.join(lines)[-2000:]}")


def ports_in(line: str) -> tuple[int, int | None]:
    """The HTTP and gRPC ports a `listening on http://127.0.0.1:PORT [and grpc://127.0.0.1:PORT]` line names."""
    grpc = int(line.split("grpc://127.0.0.1:")[1].split()[0]) if "grpc://" in line else None
    return int(line.split("http://127.0.0.1:")[1].split()[0]), grpc
