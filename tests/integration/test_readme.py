"""Every example the README shows runs as shown: its Python blocks (the tritonclient one against a real `tandem
serve`, on a free port instead of 8000), its `tandem serve --checkpoint` command and its `tandem validate` output."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton
from jobs import ROOT
from serving import (
    WAIT_S,
    inputs,
    ports_from_log,
    reference,
    request,
    serve_process,
    wait_until,
    write_checkpoint,
)

README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = [block.split("```", 1)[0] for block in README.split("```python\n")[1:]]
# The first page's `curl -s localhost:8000/v2/models/digits/infer -d '{...}'`, its continuation lines included.
CURL = re.search(r"^curl -s localhost:8000/v2/models/digits/infer -d '[^']*'$", README, re.M).group(0)


def run_python(code: str, cwd: Path) -> str:
    script = cwd / "readme_example.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return result.stdout


def block_using(name: str) -> str:
    [block] = [block for block in PYTHON_BLOCKS if name in block]
    return block


def test_every_python_block_is_one_of_the_examples_tested_here():
    assert len(PYTHON_BLOCKS) == 4
    for name in ("ParallelWrapper(", "ParallelInference(", "tritonclient.http", "tritonclient.grpc"):
        block_using(name)


def test_the_parallel_wrapper_example(tmp_path):
    accuracy = float(run_python(block_using("ParallelWrapper("), tmp_path).strip().splitlines()[-1])
    # The README's model is not seeded; sharedGradients for 30 epochs measured 0.972-0.981 over seeds 0-2
    # (bench/RESULTS.md).
    assert accuracy >= 0.95


def test_the_parallel_inference_example(tmp_path):
    run_python(block_using("ParallelInference("), tmp_path)


def test_tandem_serve_checkpoint_serves_a_file_or_a_directorys_latest_to_the_tritonclient_examples(tmp_path):
    """The README's `tandem serve examples/digits-pool.yaml --port 8000 --checkpoint runs/digits-train/checkpoints`
    (the console script, on free ports), with checkpoints written by the trainer's checkpoint writer: one file, and a
    directory of two whose latest is served. tritonclient gets the (1, 10) output of the right weights; against the
    directory's server, the README's tritonclient examples (HTTP, then gRPC) each print one row of 10 scores; each
    server exits 0 on SIGTERM. (The checkpoint cases were in test_server.py, whose tests all run under both HTTP
    fronts: the example pool names none, so both ran the same.)"""
    one = write_checkpoint(tmp_path / "file", seed=1, step=5)
    write_checkpoint(tmp_path / "directory", seed=4, step=3)
    latest = write_checkpoint(tmp_path / "directory", seed=5, step=9)
    cases = [(one, one, 1), (tmp_path / "directory", latest, 5)]  # --checkpoint, served checkpoint, its seed
    processes = [serve_process(ROOT / "examples" / "digits-pool.yaml", "--checkpoint", str(path), command="tandem")
                 for path, _, _ in cases]
    try:
        x = inputs(1)
        for process, (_, served_checkpoint, seed) in zip(processes, cases, strict=True):
            port, grpc_port = ports_from_log(process)
            wait_until(lambda p=port: request(p, "GET", "/v2/health/ready")[0] == 200, what="ready")
            client = triton.InferenceServerClient(f"127.0.0.1:{port}")
            tensor = triton.InferInput("input", [1, 64], "FP32")
            tensor.set_data_from_numpy(x)
            y = client.infer("digits", [tensor]).as_numpy("output")
            assert y.shape == (1, 10)
            np.testing.assert_allclose(y, reference(x, seed=seed), rtol=1e-5, atol=1e-6)
            assert client.get_model_repository_index() == [
                {"name": "digits", "version": "1", "state": "READY", "reason": str(served_checkpoint)}]
            client.close()
            if served_checkpoint == latest:
                for module, address in (("tritonclient.http", f"localhost:{port}"),
                                        ("tritonclient.grpc", f"localhost:{grpc_port}")):
                    code = block_using(module).replace("localhost:8000", address).replace("localhost:8001", address)
                    printed = run_python(code, tmp_path)
                    assert len(re.findall(r"[-\d.e]+", printed)) == 10, (module, printed)  # one row of 10 scores
                # The first page's curl request (a held-out digit as JSON, curl's default content type): the
                # same 10 scores as tritonclient's, as JSON.
                answer = json.loads(subprocess.run(CURL.replace("localhost:8000", f"localhost:{port}"), shell=True,
                                                   capture_output=True, text=True, check=True, timeout=60).stdout)
                [output] = answer["outputs"]
                assert (output["name"], output["shape"], len(output["data"])) == ("output", [1, 10], 10), answer
                shown = json.loads(CURL.split("-d '", 1)[1].rsplit("'", 1)[0])["inputs"][0]["data"]
                np.testing.assert_allclose(np.array(output["data"], np.float32).reshape(1, 10),
                                           reference(np.array([shown], np.float32), seed=seed), rtol=1e-5, atol=1e-6)
            process.send_signal(signal.SIGTERM)
        for process in processes:
            assert process.wait(WAIT_S) == 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_the_validate_example_prints_what_the_readme_shows(tmp_path):
    shown = README.split("    $ tandem validate bad.yaml\n", 1)[1].split("\n\n", 1)[0]
    expected = [line.strip().removesuffix("...") for line in shown.splitlines()]
    (tmp_path / "bad.yaml").write_text(
        "apiVersion: tandem.dev/v1alpha1\nkind: ParallelTrainingJob\nmetadata: {name: bad}\n"
        "spec:\n  workers: 0\n  trainingMode: ring\n  foo: 1\n"
        "  trainer: {model: tandem.examples.digits:mlp, data: tandem.examples.digits:train_data}\n")
    result = subprocess.run([sys.executable, "-m", "tandem.cli", "validate", "bad.yaml"], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode != 0
    lines = [line.strip() for line in result.stderr.splitlines()]
    assert len(lines) == len(expected), result.stderr
    for line, shown_line in zip(lines, expected, strict=True):
        assert line.startswith(shown_line), (line, shown_line)


@pytest.mark.parametrize("command", ["tandem crds", "tandem validate examples/*.yaml"])
def test_the_cli_commands_the_readme_lists_run(command):
    result = subprocess.run(command.replace("tandem", f"{sys.executable} -m tandem.cli", 1), shell=True, cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
