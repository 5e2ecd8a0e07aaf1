"""bench/native_server.py, the instrument `bench_inference.py --only native` measures against: it must answer each
request with the model's output for that request's own example (else the throughput it shows means nothing), across
its processes and concurrent connections, and refuse what it cannot read. Real processes, sockets and C compiler;
skipped, saying why, where the module cannot be built."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import native_server
from tandem.examples.digits import mlp

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: bytes) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", "/v2/models/mlp/infer", body, {"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


@pytest.fixture
def server(tmp_path: Path):
    built = native_server.build(tmp_path)
    if isinstance(built, str):
        pytest.skip(f"the native server cannot be built here: {built}")
    torch.manual_seed(0)
    model = mlp(16).eval()
    weights = tmp_path / "weights.pt"
    torch.save(model.state_dict(), weights)
    port = _free_port()
    process = subprocess.Popen([sys.executable, str(ROOT / "bench" / "native_server.py"), "--port", str(port),
                                "--weights", str(weights), "--module-dir", str(tmp_path), "--processes", "2",
                                "--hidden", "16", "--batch-limit", "4"], cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                connection.request("GET", "/v2/health/ready")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "the native server did not start"
            time.sleep(0.1)
        yield port, model
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_each_request_is_answered_with_the_models_output_for_its_own_example(server):
    port, model = server
    examples = np.random.default_rng(1).random((24, 64), dtype=np.float32)

    def ask(example: np.ndarray) -> list[float]:
        body = json.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                                       "data": example.tolist()}]}).encode()
        status, answer = _post(port, body)
        assert status == 200, answer
        return json.loads(answer)["outputs"][0]["data"]

    with ThreadPoolExecutor(8) as pool:  # concurrent connections, dealt to both processes, batched together
        answers = list(pool.map(ask, examples))
    with torch.no_grad():
        expected = model(torch.from_numpy(examples)).numpy()
    np.testing.assert_allclose(np.array(answers, dtype=np.float32), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("body", [b'{"inputs": []}', b'{"inputs": [{"data": [1, 2, "three"]}]}',
                                  b'{"inputs": [{"data": [0.5, 0.5]}]}', b'{"inputs": [{"data": [0.5, 0.5'],
                         ids=["no data", "not numbers", "too few numbers", "cut short"])
def test_a_request_it_cannot_read_is_refused_and_the_server_serves_on(server, body):
    port, _ = server
    assert _post(port, body)[0] == 400
    example = json.dumps({"inputs": [{"data": [0.5] * 64}]}).encode()
    assert _post(port, example)[0] == 200
