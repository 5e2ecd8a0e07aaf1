"""A pod's server processes (processesPerReplica) keep one face: two InferenceServers of one group, each on a port of
its own so that the test chooses which one it asks (in a pod they share the ports), talking over their real Unix
sockets. What is asked of one is done by both (batching changes, loads, followed swaps, skipped candidates), and
what one is asked about counts both (statistics over HTTP and gRPC, /metrics, readiness)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
from serving import inputs, make_pool, reference, request, wait_until, write_checkpoint

from tandem.api.inference import BatchingSettings
from tandem.worker.serve.processes import Group
from tandem.worker.serve.served_model import BatchingRefused


@pytest.fixture
def group_directory():
    directory = Path(tempfile.mkdtemp(prefix="tandem-group-"))  # short: a Unix socket's path is at most 107 bytes
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def two_processes(served, group_directory, pool, checkpoint=None, pools=None, **kwargs):
    """Process 0 (the leader) and process 1 of one group; `pools` gives each its own pool instead."""
    pools = pools or [pool, pool]
    return [served(pools[index], checkpoint, group=Group(group_directory, index, 2), **kwargs) for index in range(2)]


def metric(port: int, series: str) -> float:
    text = request(port, "GET", "/metrics")[2].decode()
    return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(series)))


def test_statistics_metrics_and_readiness_count_every_process(served, group_directory):
    leader, other = two_processes(served, group_directory, make_pool(), grpc=True)
    for server, count in ((leader, 3), (other, 2)):
        client = triton.InferenceServerClient(server.url)
        for _ in range(count):
            x = inputs(1)
            tensor = triton.InferInput("input", [1, 64], "FP32")
            tensor.set_data_from_numpy(x)
            client.infer("digits", [tensor])
        client.close()
    request(other.port, "POST", "/v2/models/digits/infer", b"not json")
    for server in (leader, other):
        stats = json.loads(request(server.port, "GET", "/v2/models/digits/stats")[2])["model_stats"][0]
        assert (stats["inference_count"], stats["inference_stats"]["success"]["count"]) == (5, 5)
        assert sum(batch["compute_infer"]["count"] for batch in stats["batch_stats"]) == stats["execution_count"]
        assert metric(server.port, 'tandem_inference_requests_total{model="digits",outcome="success"}') == 5
        assert metric(server.port, 'tandem_inference_requests_total{model="digits",outcome="invalid"}') == 1
        assert metric(server.port, 'tandem_inference_examples_total{model="digits"}') == 5
        grpc = triton_grpc.InferenceServerClient(server.grpc_url)
        assert int(grpc.get_inference_statistics("digits").model_stats[0].inference_count) == 5
        assert grpc.is_server_ready() and grpc.is_model_ready("digits")
        grpc.close()
        assert request(server.port, "GET", "/v2/health/ready")[0] == 200
    other.stop()
    assert request(leader.port, "GET", "/v2/health/ready")[0] == 503  # a process that does not answer is not ready
    assert request(leader.port, "GET", "/v2/models/digits/ready")[0] == 503
    status, _, body = request(leader.port, "GET", "/v2/models/digits/stats")
    assert status == 503 and "server process 2 of 2 did not answer" in json.loads(body)["error"]
    assert request(leader.port, "GET", "/v2/health/live")[0] == 200


def mapped_file(tensor) -> str | None:
    """The file the memory of `tensor` is mapped from (None: anonymous memory), from /proc/self/maps."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) == 6 else None
    return None


def test_the_processes_serve_the_leaders_weights_from_one_file(served, group_directory):
    """A model whose weights are random (built again, differently, by each process) answers alike in both: the
    leader's weights are every process's, each mapping the one file (in a pod: one copy in memory), also after a
    batching change brings new replicas."""
    pool = make_pool(model={"callable": "tandem.examples.digits:mlp", "args": {"hidden": 16}, "inputShape": [64]})
    leader, other = two_processes(served, group_directory, pool)
    x = inputs(3)

    def answers(server) -> np.ndarray:
        client = triton.InferenceServerClient(server.url)
        tensor = triton.InferInput("input", [3, 64], "FP32")
        tensor.set_data_from_numpy(x)
        answer = client.infer("digits", [tensor]).as_numpy("output")
        client.close()
        return answer

    def mapped(server) -> set[str | None]:
        return {mapped_file(weight) for replica in server.server.model.inference.replicas
                for weight in replica.state_dict().values()}

    np.testing.assert_array_equal(answers(leader), answers(other))
    weights = str(group_directory / "weights-1.pt")
    assert mapped(leader) == mapped(other) == {weights}
    other.update_batching(BatchingSettings(batchLimit=64))
    np.testing.assert_array_equal(answers(leader), answers(other))
    assert mapped(leader) == mapped(other) == {weights}


def test_a_batching_change_reaches_every_process(served, group_directory):
    leader, other = two_processes(served, group_directory, make_pool())
    other.update_batching(BatchingSettings(batchLimit=8, queueLimit=50))  # handed to the leader, made in both
    for server in (leader, other):
        assert json.loads(request(server.port, "GET", "/v2/models/digits/batching")[2])["batchLimit"] == 8
        assert metric(server.port, 'tandem_inference_queue_limit{model="digits"}') == 50
        assert server.server.model.inference.batch_limit == 8


def test_a_batching_change_one_process_refuses_is_undone_in_the_others(served, group_directory):
    """The two processes run different models here (only the second fails at 8 examples), so that one accepts the
    change and the other refuses it: in a pod both run the same model and refuse alike."""
    pools = [make_pool(model={"callable": "inference_models:at_most", "args": {"rows": rows}, "inputShape": [64]},
                       batchLimit=4) for rows in (16, 4)]
    leader, other = two_processes(served, group_directory, None, pools=pools)
    with pytest.raises(BatchingRefused) as refused:
        leader.update_batching(BatchingSettings(batchLimit=8, queueLimit=50))
    assert "server process 2 of 2: the model fails its warm-up at the new batch sizes: RuntimeError: this model " \
           "takes at most 4 examples, not 8" in str(refused.value)
    for server in (leader, other):
        assert json.loads(request(server.port, "GET", "/v2/models/digits/batching")[2])["batchLimit"] == 4
        assert server.server.model.inference.batch_limit == 4


def test_a_load_request_to_one_process_swaps_them_all(served, group_directory, tmp_path):
    first = write_checkpoint(tmp_path / "repo", seed=1, step=1)
    newer = write_checkpoint(tmp_path / "repo", seed=2, step=2)
    pool = make_pool(model={"checkpoint": str(first)}, modelRepository={"load": True})
    leader, other = two_processes(served, group_directory, pool)
    status, _, body = request(other.port, "POST", "/v2/repository/models/digits/load",
                              json.dumps({"parameters": {"checkpoint": str(newer)}}).encode())
    assert (status, json.loads(body)["checkpoint"]) == (200, str(newer))
    x = inputs(2)
    for server in (leader, other):
        client = triton.InferenceServerClient(server.url)
        assert client.get_model_metadata("digits")["parameters"]["checkpoint"] == str(newer)
        tensor = triton.InferInput("input", [2, 64], "FP32")
        tensor.set_data_from_numpy(x)
        np.testing.assert_allclose(client.infer("digits", [tensor]).as_numpy("output"), reference(x, seed=2),
                                   rtol=1e-5, atol=1e-6)
        client.close()
    status, _, body = request(leader.port, "POST", "/v2/repository/models/digits/load",
                              json.dumps({"parameters": {"checkpoint": str(tmp_path / "repo" / "none.pt")}}).encode())
    assert status == 400
    assert other.server.model.loaded.checkpoint == str(newer)


def test_the_leader_follows_the_job_for_the_group(served, group_directory, tmp_path):
    """Only process 0 watches the checkpoint directory; every process swaps to what it promotes, and every process
    reports the candidate its gate skipped."""
    directory = tmp_path / "checkpoints"
    write_checkpoint(directory, seed=1, step=10, metrics={"accuracy": 0.5})
    job = {"name": "digits-train", "follow": True, "promote": {"metric": "accuracy", "mode": "max"}}
    leader, other = two_processes(served, group_directory, make_pool(model={"fromTrainingJob": job}), str(directory),
                                  follow_interval=0.05)
    assert leader.server.model._follower is not None and other.server.model._follower is None
    better = write_checkpoint(directory, seed=2, step=20, metrics={"accuracy": 0.7})
    # the leader switches itself once the others have (served_model.swap): wait for both
    wait_until(lambda: all(server.server.model.loaded.checkpoint == str(better) for server in (leader, other)),
               what="the promoted checkpoint everywhere")
    worse = write_checkpoint(directory, seed=3, step=30, metrics={"accuracy": 0.6})
    wait_until(lambda: other.server.model.skipped is not None, what="the skipped candidate everywhere")
    for server in (leader, other):
        parameters = triton.InferenceServerClient(server.url).get_model_metadata("digits")["parameters"]
        assert (parameters["checkpoint"], parameters["skipped_checkpoint"], parameters["skipped_metric"]) == \
            (str(better), str(worse), 0.6)


def test_a_swap_one_process_cannot_prepare_switches_none(served, group_directory, tmp_path):
    """The second process's model cannot be built again once a flag file exists (its pool names the file, the
    leader's another), so that a reload is prepared by the leader and fails in the other: in a pod both load alike."""
    flag = tmp_path / "flag"
    pools = [make_pool(model={"callable": "inference_models:unbuildable_once", "args": {"flag": str(path)},
                              "inputShape": [64]}, modelRepository={"load": True}) for path in (tmp_path / "no", flag)]
    leader, other = two_processes(served, group_directory, None, pools=pools)
    served_before = [server.server.model.loaded for server in (leader, other)]
    flag.touch()
    status, _, body = request(leader.port, "POST", "/v2/repository/models/digits/load", b"")
    assert status == 400 and "server process 2 of 2" in json.loads(body)["error"], body
    assert [server.server.model.loaded for server in (leader, other)] == served_before
    flag.unlink()
    status, _, body = request(other.port, "POST", "/v2/repository/models/digits/load", b"")  # nothing left held
    assert status == 200, body
    now = [server.server.model.loaded for server in (leader, other)]
    assert all(loaded is not before for loaded, before in zip(now, served_before, strict=True))
