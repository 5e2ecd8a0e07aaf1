"""ParallelInference in process: real threads and real models; requests are held at a known point with a gate
(inference_models.Gate), never with sleeps or timed assertions."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch
from inference_models import GATES, POISON, Forward, at_most, gated_mlp, recorder, seeded_mlp

from tandem import ParallelInference
from tandem.worker.serve.batching import fuller_batch_wait
from tandem.worker.serve.inference import InferenceTimeout, ModelError, QueueFullError, ShutDownError
from tandem.worker.serve.metrics import merge_states
from tandem.worker.serve.replicas import build_replicas, warmup_sizes
from tandem.worker.serve.stats import InferenceStats, merge_snapshots

torch.set_num_threads(1)
MODES = ("batched", "sequential", "inplace")


@pytest.fixture
def gate(request):
    """A fresh gate named after the test, with its model."""
    name = request.node.name
    GATES.pop(name, None)
    model = gated_mlp(name)
    yield model, GATES[name]
    GATES[name].open.set()


def _inputs(count: int, seed: int = 1) -> torch.Tensor:
    return torch.rand(count, 64, generator=torch.Generator().manual_seed(seed))


def _in_threads(function, items, threads: int = 16) -> list:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(function, items))


@pytest.mark.parametrize("mode", MODES)
def test_concurrent_callers_each_get_their_own_output(mode):
    model = seeded_mlp()
    x = _inputs(96)
    with ParallelInference(model, mode=mode, workers=2, queue_limit=256) as inference:
        outputs = _in_threads(lambda i: inference.output(x[i:i + 1]), range(len(x)))
    torch.testing.assert_close(torch.cat(outputs), model(x))


def test_the_three_modes_give_identical_outputs():
    model = seeded_mlp(seed=3)
    x = _inputs(40, seed=2)
    results = {}
    for mode in MODES:
        with ParallelInference(model, mode=mode, workers=2, queue_limit=64) as inference:
            results[mode] = torch.cat(_in_threads(lambda i, inf=inference: inf.output(x[i:i + 1]), range(len(x))))
    torch.testing.assert_close(results["batched"], results["sequential"])
    torch.testing.assert_close(results["sequential"], results["inplace"])


def test_batched_mode_merges_queued_requests_into_one_forward(gate):
    model, gate = gate
    x = _inputs(9)
    with ParallelInference(model, workers=1, batch_limit=32) as inference, ThreadPoolExecutor(9) as pool:
        futures = _hold(inference, gate, pool, x)  # the worker is busy with the first, eight wait
        gate.open.set()
        outputs = [f.result(60) for f in futures]
    assert gate.batches == [1, 8]
    torch.testing.assert_close(torch.cat(outputs), model.inner(x))


def test_batches_hold_at_most_batch_limit_examples(gate):
    model, gate = gate
    x = _inputs(11)
    with ParallelInference(model, workers=1, batch_limit=4) as inference, ThreadPoolExecutor(11) as pool:
        futures = _hold(inference, gate, pool, x)
        gate.open.set()
        outputs = [f.result(60) for f in futures]
    assert gate.batches == [1, 4, 4, 2]
    torch.testing.assert_close(torch.cat(outputs), model.inner(x))


def test_beside_a_busy_forward_a_free_worker_waits_for_a_full_batch(gate):
    model, gate = gate
    x = _inputs(7)
    with ParallelInference(model, workers=2, batch_limit=4) as inference, ThreadPoolExecutor(5) as pool:
        inference._forward_ns = 10**15  # as if the last forward had taken days: only a full batch ends the wait
        gate.close()
        futures = [pool.submit(inference.output, x[:3])]
        gate.wait_entered(1)  # one worker's forward of 3 examples is held; the other is free
        futures += [pool.submit(inference.output, x[i:i + 1]) for i in range(3, 7)]
        gate.wait_entered(2)
        gate.open.set()
        outputs = [f.result(60) for f in futures]
    assert gate.batches == [3, 4]  # not a forward of the first request or two to arrive beside the held one
    torch.testing.assert_close(torch.cat(outputs), model.inner(x))


def test_under_light_load_a_free_worker_runs_a_partial_batch_beside_a_running_forward(gate):
    """Queued and running together less than a full batch: the free worker's core would idle while it waited."""
    model, gate = gate
    x = _inputs(2)
    with ParallelInference(model, workers=2, batch_limit=4) as inference, ThreadPoolExecutor(2) as pool:
        inference._forward_ns = 10**15
        gate.close()
        futures = [pool.submit(inference.output, x[:1])]
        gate.wait_entered(1)
        futures.append(pool.submit(inference.output, x[1:]))
        gate.wait_entered(2)  # the second forward starts while the first is held
        gate.open.set()
        outputs = [f.result(60) for f in futures]
    assert gate.batches == [1, 1]
    torch.testing.assert_close(torch.cat(outputs), model.inner(x))


def test_a_worker_alone_waits_for_as_many_examples_as_its_last_forward_had(gate):
    """A closed loop of three clients on one worker: after their forward, the first to send again waits for the other
    two rather than running a forward of one."""
    model, gate = gate
    x = _inputs(6)
    with ParallelInference(model, workers=1, batch_limit=4) as inference, ThreadPoolExecutor(3) as pool:
        torch.testing.assert_close(inference.output(x[:3]), model.inner(x[:3]))  # the last forward: 3 examples
        inference._forward_ns = 10**15  # as if it had taken days: only the three queued end the wait
        futures = [pool.submit(inference.output, x[3:4])]
        _wait_until(lambda: inference._filling_workers == 1 or len(gate.batches) == 2)
        futures += [pool.submit(inference.output, x[i:i + 1]) for i in (4, 5)]
        outputs = [f.result(60) for f in futures]
    assert gate.batches == [3, 3]  # not a forward of the first to come back
    torch.testing.assert_close(torch.cat(outputs), model.inner(x[3:]))


@pytest.mark.parametrize(("queued_rows", "running_rows", "shared_device", "oldest_waited_ns", "idle_ns", "last_rows",
                          "expected_ns"), [
    (3, 1, True, 0, 0, 4, 1000),        # another forward on the same cores and a partial batch: wait
    (3, 1, True, 400, 0, 4, 600),       # ... until the oldest has waited as long as the last forward took
    (3, 1, True, 1500, 0, 4, 0),        # ... and no longer
    (1, 3, True, 0, 0, 4, 1000),        # queued and running make a full batch: wait
    (2, 1, True, 0, 0, 4, 0),           # light load (less than a full batch in all): the partial batch goes at once
    (4, 2, True, 0, 0, 4, 0),           # a full batch goes at once
    (9, 2, True, 0, 0, 4, 0),
    (3, 0, True, 0, 0, 4, 1000),        # nothing else runs: as a worker alone (below), fewer than the last forward
    (3, 0, True, 1000, 1000, 4, 0),     # ... until it has idled as long as the last forward took
    (4, 0, True, 0, 0, 9, 0),           # ... and a full batch goes at once
    (1, 0, False, 0, 0, 3, 1000),       # a worker alone: fewer queued than its last forward had: wait
    (1, 2, False, 0, 0, 3, 1000),       # ... whatever runs on other devices
    (2, 0, False, 700, 700, 3, 300),    # ... until it has idled as long as the last forward took
    (2, 0, False, 1000, 1000, 3, 0),    # ... and no longer
    (1, 0, False, 5000, 100, 3, 900),   # ... however long the oldest waited (left over from the last batch)
    (3, 0, False, 0, 0, 3, 0),          # as many as the last forward had: go
    (1, 0, False, 0, 0, 1, 0),          # light load: the last forward had one
    (1, 0, False, 0, 0, 0, 0),          # no forward yet
    (4, 0, False, 0, 0, 9, 0),          # a full batch goes at once
])
def test_when_a_free_worker_waits_for_a_fuller_batch(queued_rows, running_rows, shared_device, oldest_waited_ns,
                                                     idle_ns, last_rows, expected_ns):
    assert fuller_batch_wait(queued_rows, 4, running_rows, shared_device, oldest_waited_ns, idle_ns, 1000,
                             last_rows) == expected_ns


# Requests queued behind request 1 (held at the gate), in this order: (request id, input shape with the examples
# first, dtype; a numpy dtype means a numpy array). Every value of a request's input is its id.
COMPOSITION = [
    (1, (1, 4), torch.float32),
    (2, (1, 4), torch.float32),
    (3, (2, 3), torch.float32),     # another shape
    (4, (1, 4), torch.float64),     # another dtype, same shape
    (5, (2, 4), torch.float32),
    (6, (1, 2, 2), torch.float32),  # as many values per example as (4,), another shape
    (7, (1, 4), torch.float64),
    (8, (1, 3), torch.float32),
    (9, (1, 4), torch.int64),
    (10, (3, 4), torch.float32),
    (11, (1, 4), np.float32),       # numpy: batched with numpy requests only (numpy in, numpy out)
    (12, (2, 4), np.float32),
]


def test_batched_mode_merges_requests_of_one_shape_and_dtype_and_never_mixes_shapes_or_dtypes():
    """Which requests shared a forward, as the model saw it. The forwards must be exactly these: requests of one
    per-example shape and dtype merged (in queue order), no forward mixing two. A batching that ignored the
    shape would fail here (its merged batch fails to concatenate and is retried request by request, so the
    outputs alone would look right), and so would one that ignored the dtype (torch.cat promotes float32 to
    float64: the merged forward and its answers would be float64)."""
    name = "composition"
    GATES.pop(name, None)
    model = recorder(name)
    gate = GATES[name]

    def make(request_id, shape, dtype):
        if isinstance(dtype, torch.dtype):
            return torch.full(shape, request_id, dtype=dtype)
        return np.full(shape, request_id, dtype=dtype)

    xs = [make(*request) for request in COMPOSITION]
    try:
        with ParallelInference(model, workers=1, batch_limit=32, queue_limit=64) as inference, \
                ThreadPoolExecutor(len(xs)) as pool:
            futures = _hold_each(inference, gate, pool, xs)
            gate.open.set()
            answers = [f.result(60) for f in futures]
    finally:
        gate.open.set()
    f32, f64 = torch.float32, torch.float64
    assert gate.forwards == [
        Forward((1,), (4,), f32),  # alone: it ran while the others queued
        Forward((2, 5, 5, 10, 10, 10), (4,), f32),
        Forward((3, 3, 8), (3,), f32),
        Forward((4, 7), (4,), f64),
        Forward((6,), (2, 2), f32),
        Forward((9,), (4,), torch.int64),
        Forward((11, 12, 12), (4,), f32),
    ]
    for (request_id, shape, _), x, y in zip(COMPOSITION, xs, answers, strict=True):
        assert type(y) is type(x) and y.dtype == x.dtype, (request_id, type(y), y.dtype)
        assert tuple(y.shape) == (shape[0], 1) and (y == request_id).all(), (request_id, y)


def test_a_large_request_runs_alone_and_numpy_in_gives_numpy_out():
    model = seeded_mlp()
    x = _inputs(50).numpy()
    with ParallelInference(model, batch_limit=8) as inference:
        y = inference.output(x)
    assert isinstance(y, np.ndarray) and y.shape == (50, 10)
    np.testing.assert_allclose(y, model(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_sequential_mode_runs_one_request_per_forward_in_order(gate):
    model, gate = gate
    x = torch.arange(5, dtype=torch.float32).repeat_interleave(64).reshape(5, 64)
    seen = []
    original = model.inner.forward

    def recording(batch):
        seen.append(batch[:, 0].tolist())
        return original(batch)

    model.inner.forward = recording  # replicas are deep copies: patch before ParallelInference copies it
    with ParallelInference(model, mode="sequential", workers=1) as inference, ThreadPoolExecutor(5) as pool:
        futures = _hold(inference, gate, pool, x)
        gate.open.set()
        [f.result(60) for f in futures]
    assert gate.batches == [1, 1, 1, 1, 1]
    assert seen == [[0.0], [1.0], [2.0], [3.0], [4.0]]


def test_inplace_mode_runs_on_the_callers_thread(gate):
    model, gate = gate
    with ParallelInference(model, mode="inplace", workers=2) as inference:
        inference.output(_inputs(1))
        threading.Thread(target=inference.output, args=(_inputs(1),), name="caller-2").start()
        gate.wait_entered(2)
    assert gate.threads[-2:] in (["MainThread", "caller-2"], ["caller-2", "MainThread"])


def test_a_full_queue_is_rejected_at_once_and_accepted_requests_succeed(gate):
    model, gate = gate
    x = _inputs(5)
    with ParallelInference(model, workers=1, batch_limit=1, queue_limit=3) as inference, \
            ThreadPoolExecutor(4) as pool:
        accepted = _hold(inference, gate, pool, x[:4])
        with pytest.raises(QueueFullError, match="queue full: 3 requests already waiting"):
            inference.output(x[4:5])
        assert inference.stats.snapshot()["rejected_count"] == 1
        gate.open.set()
        outputs = [f.result(60) for f in accepted]
    torch.testing.assert_close(torch.cat(outputs), model.inner(x[:4]))


def test_inplace_mode_rejects_callers_beyond_the_queue_limit(gate):
    model, gate = gate
    with ParallelInference(model, mode="inplace", workers=1, queue_limit=1) as inference, \
            ThreadPoolExecutor(2) as pool:
        held = _hold(inference, gate, pool, _inputs(2))
        with pytest.raises(QueueFullError):
            inference.output(_inputs(1))
        gate.open.set()
        [f.result(60) for f in held]


def test_a_request_times_out_in_the_queue_and_leaves_it(gate):
    model, gate = gate
    with ParallelInference(model, workers=1) as inference, ThreadPoolExecutor(1) as pool:
        [running] = _hold(inference, gate, pool, _inputs(1))
        with pytest.raises(InferenceTimeout, match="timeout of 50 ms"):
            inference.output(_inputs(1), timeout=0.05)
        assert inference.queued == 0
        gate.open.set()
        running.result(60)
        assert inference.stats.snapshot()["fail_count"] == 1


def test_an_exception_in_a_forward_fails_only_the_request_that_caused_it(gate):
    model, gate = gate
    x = _inputs(6)
    x[3, 7] = POISON
    with ParallelInference(model, workers=1) as inference, ThreadPoolExecutor(6) as pool:
        first, *rest = _hold(inference, gate, pool, x)
        gate.open.set()
        first.result(60)
        with pytest.raises(ModelError, match=r"forward failed: ValueError: poisoned input"):
            rest[2].result(60)
        good = [rest[i].result(60) for i in (0, 1, 3, 4)]
        assert 5 in gate.batches  # the five queued requests were tried as one batch first
        # after that batch failed, each request was retried on its own
    torch.testing.assert_close(torch.cat(good), model.inner(x[[1, 2, 4, 5]]))
    # the worker survives and keeps serving
    with ParallelInference(model, workers=1) as inference:
        torch.testing.assert_close(inference.output(x[:2]), model.inner(x[:2]))


def test_a_model_returning_the_wrong_rows_is_a_model_error():
    class Collapse(torch.nn.Module):
        def forward(self, x):
            return x.sum(dim=0, keepdim=True)

    expected = r"shape \(1, 64\) for a batch of 3"
    with ParallelInference(Collapse()) as inference, pytest.raises(ModelError, match=expected):
        inference.output(_inputs(3))


def test_update_model_switches_without_failing_requests_and_running_ones_finish_on_the_old_model(gate):
    old, gate = gate
    new = seeded_mlp(seed=7)
    x = _inputs(1)
    with ParallelInference(old, workers=2, example=x) as inference, ThreadPoolExecutor(1) as pool:
        gate.close()
        running = pool.submit(inference.output, x)
        gate.wait_entered(1)
        inference.update_model(new)  # returns while the old model is still mid-forward
        torch.testing.assert_close(inference.output(x), new(x))
        gate.open.set()
        torch.testing.assert_close(running.result(60), old.inner(x))


class Clients:
    """Eight client threads, each sending its own row of `x` to `inference` again and again (at most 10,000 times)
    until `stop()`: the errors it raised and the answers `expected(index, y)` refused are in `errors`, each client's
    count of answers in `counts`."""

    def __init__(self, inference: ParallelInference, x: torch.Tensor, expected, what: str) -> None:
        self.inference, self.x, self.expected, self.what = inference, x, expected, what
        self.stopped = threading.Event()
        self.errors: list[Exception] = []
        self.counts: list[int] = []
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(8)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int) -> None:
        row = self.x[index:index + 1]
        served = 0
        while not self.stopped.is_set() and served < 10_000:
            try:
                y = self.inference.output(row)
            except Exception as error:  # recorded: the tests assert there are none
                self.errors.append(error)
                return
            if not self.expected(index, y):
                self.errors.append(AssertionError(f"client {index} got {self.what}"))
            served += 1
        self.counts.append(served)

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(60)


def test_update_model_under_concurrent_load_fails_nothing():
    old, new = seeded_mlp(seed=1), seeded_mlp(seed=2)
    x = _inputs(32)
    expected_old, expected_new = old(x), new(x)

    def from_either(index: int, y: torch.Tensor) -> bool:
        rows = slice(index, index + 1)
        return torch.allclose(y, expected_old[rows]) or torch.allclose(y, expected_new[rows])

    with ParallelInference(old, workers=2, queue_limit=64, example=x[:1]) as inference:
        clients = Clients(inference, x, from_either, "an output from neither model")
        _wait_executions(inference, 20)
        inference.update_model(new)
        after = inference.stats.snapshot()["execution_count"]
        _wait_executions(inference, after + 20)
        clients.stop()
        assert not clients.errors
        torch.testing.assert_close(inference.output(x), expected_new)
    # each of the 40 forwards waited for answered a request; measured (5 runs): 113..256
    assert sum(clients.counts) >= 40


def test_a_new_model_that_fails_warm_up_leaves_the_old_one_serving():
    old = seeded_mlp()
    x = _inputs(2)
    with ParallelInference(old, example=x[:1]) as inference:
        with pytest.raises(RuntimeError):
            inference.update_model(torch.nn.Linear(3, 3))  # cannot take 64 features
        torch.testing.assert_close(inference.output(x), old(x))


def test_warm_up_runs_every_batch_size_in_use_on_the_model_the_workers_share(gate):
    model, gate = gate
    gate.close()
    gate.open.set()
    with ParallelInference(model, workers=2, batch_limit=12, example=_inputs(1)):
        pass
    assert sorted(gate.batches) == [1, 2, 4, 8, 12]  # two workers on the CPU: one copy, warmed up once
    assert warmup_sizes("sequential", 32, 3) == [1, 3]


@pytest.mark.parametrize(("devices", "copies"), [
    (["cpu"], [0]),
    (["cpu", "cpu", "cpu"], [0, 0, 0]),
    (["cpu", "meta", "cpu", "meta"], [0, 1, 0, 1]),
])
def test_workers_on_one_device_share_one_frozen_copy_of_the_model(devices, copies):
    model = seeded_mlp().train()
    replicas = build_replicas(model, [torch.device(d) for d in devices], None, [])
    distinct = list({id(replica): replica for replica in replicas}.values())
    assert [distinct.index(replica) for replica in replicas] == copies
    for replica, device in zip(replicas, devices, strict=True):
        assert replica is not model and not replica.training
        assert all(p.device.type == device and not p.requires_grad for p in replica.parameters())
    assert model.training and all(p.requires_grad for p in model.parameters())  # the caller's model is left alone


def test_a_lowered_batch_limit_applies_to_the_requests_already_queued(gate):
    model, gate = gate
    x = _inputs(11)
    with ParallelInference(model, workers=1, batch_limit=32) as inference, ThreadPoolExecutor(11) as pool:
        futures = _hold(inference, gate, pool, x)  # one running at the gate, ten queued
        inference.update(batch_limit=3)
        gate.open.set()
        outputs = [f.result(60) for f in futures]
    assert gate.batches == [1, 3, 3, 3, 1]
    torch.testing.assert_close(torch.cat(outputs), model.inner(x))


def test_a_lowered_queue_limit_keeps_the_queued_requests_and_refuses_new_ones(gate):
    model, gate = gate
    x = _inputs(6)
    with ParallelInference(model, workers=1, batch_limit=1, queue_limit=8) as inference, \
            ThreadPoolExecutor(6) as pool:
        futures = _hold(inference, gate, pool, x)  # one running, five queued
        inference.update(queue_limit=2)
        with pytest.raises(QueueFullError, match="queue_limit=2"):
            inference.output(x[:1])
        gate.open.set()
        outputs = [f.result(60) for f in futures]
        torch.testing.assert_close(inference.output(x[:1]), model.inner(x[:1]))
    torch.testing.assert_close(torch.cat(outputs), model.inner(x))
    assert inference.stats.snapshot()["rejected_count"] == 1


def test_a_raised_batch_limit_is_warmed_up_at_its_new_sizes_before_it_is_used(gate):
    model, gate = gate
    gate.close()
    gate.open.set()
    with ParallelInference(model, workers=2, batch_limit=4, example=_inputs(1)) as inference:
        gate.batches.clear()
        inference.update(batch_limit=12)
        assert sorted(gate.batches) == [1, 2, 4, 8, 12], "a new shared copy, warmed at every size in use"
        gate.batches.clear()
        inference.update(batch_limit=2, max_delay_us=10)
        assert gate.batches == [], "every size of a lower limit is warm already"
        assert (inference.batch_limit, inference.max_delay_s) == (2, 10e-6)


def test_an_update_under_concurrent_load_fails_nothing_and_the_new_batch_limit_shows_in_the_batch_sizes():
    model = seeded_mlp(seed=3)
    x = _inputs(32)
    expected = model(x)

    with ParallelInference(model, workers=2, batch_limit=32, queue_limit=64, example=x[:1]) as inference:
        clients = Clients(inference, x, lambda index, y: torch.allclose(y, expected[index:index + 1]),
                          "another request's output")
        _wait_executions(inference, 20)
        inference.update(batch_limit=48, queue_limit=16, max_delay_us=50)  # new sizes: warmed up while serving
        _wait_executions(inference, inference.stats.snapshot()["execution_count"] + 20)
        inference.update(batch_limit=2, max_delay_us=0)
        before = inference.stats.snapshot()["batches"]
        _wait_executions(inference, inference.stats.snapshot()["execution_count"] + 40)
        clients.stop()
        after = inference.stats.snapshot()["batches"]
    assert not clients.errors, clients.errors[:3]
    new = {size: after[size][0] - before.get(size, [0])[0] for size in after}
    assert sum(count for size, count in new.items() if size > 2) <= 2, \
        f"only the batches the two workers had taken before the update may be larger: {new}"
    assert sum(count for size, count in new.items() if size <= 2) >= 38
    assert sum(clients.counts) >= 80


def test_a_batch_limit_the_model_cannot_run_is_refused_by_its_warm_up_and_changes_nothing():
    model = at_most(4)
    x = _inputs(4)
    with ParallelInference(model, workers=2, batch_limit=4, example=x[:1]) as inference:
        with pytest.raises(RuntimeError, match="at most 4 examples, not 8"):
            inference.update(batch_limit=8, queue_limit=9)
        assert (inference.batch_limit, inference.queue_limit) == (4, 64)
        torch.testing.assert_close(inference.output(x), model(x))


def test_bad_updates_are_named_and_change_nothing():
    with ParallelInference(seeded_mlp(), batch_limit=8) as inference:
        for kwargs, message in [({"batch_limit": 0}, "batch_limit must be an integer >= 1"),
                                ({"queue_limit": 2.5}, "queue_limit must be an integer >= 1"),
                                ({"max_delay_us": -1}, "max_delay_us must be an integer >= 0")]:
            with pytest.raises(ValueError, match=message):
                inference.update(**kwargs)
        assert (inference.batch_limit, inference.queue_limit, inference.max_delay_s) == (8, 64, 0)


def test_shutdown_finishes_queued_requests_then_refuses_new_ones(gate):
    model, gate = gate
    x = _inputs(4)
    inference = ParallelInference(model, workers=1, batch_limit=1)
    with ThreadPoolExecutor(5) as pool:
        futures = _hold(inference, gate, pool, x)
        stopping = pool.submit(inference.shutdown)
        _wait_until(lambda: inference.closed)
        with pytest.raises(ShutDownError):
            inference.output(x[:1])
        gate.open.set()
        stopping.result(60)
        outputs = [f.result(60) for f in futures]
    torch.testing.assert_close(torch.cat(outputs), model.inner(x))


def test_shutdown_without_drain_fails_what_is_queued(gate):
    model, gate = gate
    inference = ParallelInference(model, workers=1, batch_limit=1)
    with ThreadPoolExecutor(2) as pool:
        running, queued = _hold(inference, gate, pool, _inputs(2))
        inference.shutdown(drain=False, timeout=0)
        with pytest.raises(ShutDownError):
            queued.result(60)
        gate.open.set()
        running.result(60)


def test_max_delay_waits_for_a_full_batch(gate):
    model, gate = gate
    x = _inputs(4)
    # A delay far longer than the test: the batch goes as soon as it holds batch_limit examples.
    with ParallelInference(model, workers=1, batch_limit=4, max_delay_us=600_000_000) as inference:
        gate.close()
        gate.open.set()
        outputs = _in_threads(lambda i: inference.output(x[i:i + 1]), range(4), threads=4)
    assert gate.batches == [4]
    torch.testing.assert_close(torch.cat(outputs), model.inner(x))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "parallel"}, "mode must be one of batched, sequential, inplace"),
    ({"workers": 0}, "workers must be an integer >= 1"),
    ({"batch_limit": 0}, "batch_limit must be an integer >= 1"),
    ({"queue_limit": -1}, "queue_limit must be an integer >= 1"),
    ({"devices": ["cpu"], "workers": 2}, "devices lists 1 devices for 2 workers"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelInference(seeded_mlp(), **kwargs)


def test_an_input_without_a_batch_dimension_is_refused():
    with ParallelInference(seeded_mlp()) as inference, pytest.raises(ValueError, match="batch dimension"):
        inference.output(torch.tensor(1.0))


def test_the_callback_api_answers_on_a_worker_thread():
    model = seeded_mlp()
    x = _inputs(3)
    done = threading.Event()
    answers = []
    with ParallelInference(model) as inference:
        inference.submit(x, lambda output, error: (answers.append((output, error, threading.current_thread().name)),
                                                   done.set()))
        assert done.wait(60)
    output, error, thread = answers[0]
    assert error is None and thread.startswith("tandem-inference-")
    torch.testing.assert_close(output, model(x))


def _hold(inference: ParallelInference, gate, pool: ThreadPoolExecutor, rows: torch.Tensor) -> list[Future]:
    """Close the gate, send the first row (its forward waits at the gate) and queue the others behind it in
    order, one request per row; returns their futures."""
    return _hold_each(inference, gate, pool, [rows[i:i + 1] for i in range(len(rows))])


def _hold_each(inference: ParallelInference, gate, pool: ThreadPoolExecutor, xs: list) -> list[Future]:
    """Close the gate, send xs[0] (its forward waits at the gate) and queue the others behind it in order, one
    request each; returns their futures."""
    gate.close()
    futures = [pool.submit(inference.output, xs[0])]
    gate.wait_entered(1)
    for i in range(1, len(xs)):
        futures.append(pool.submit(inference.output, xs[i]))
        _wait_queued(inference, i)
    return futures


def _wait_until(condition, timeout: float = 60.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.005)):
        if condition():
            return
        done.wait(0.005)
    raise TimeoutError("condition not reached")


def _wait_queued(inference: ParallelInference, count: int) -> None:
    _wait_until(lambda: inference.queued >= count)


def _wait_executions(inference: ParallelInference, count: int) -> None:
    _wait_until(lambda: inference.stats.snapshot()["execution_count"] >= count)


def _snapshot(requests: int, rows: int, ms: int) -> dict:
    stats = InferenceStats()
    submitted = [type("Request", (), {"arrivals": (0,)})() for _ in range(requests)]
    stats.batch(submitted, rows, start=1_000, infer=2_000, output=3_000, end=4_000, ok=[True] * requests)
    snapshot = stats.snapshot()
    snapshot["last_inference_ms"] = ms
    return snapshot


def test_the_snapshots_of_a_pods_processes_merge_into_one():
    first, second = _snapshot(2, rows=3, ms=100), _snapshot(1, rows=5, ms=50)
    second = merge_snapshots([second, _snapshot(1, rows=3, ms=70)])
    merged = merge_snapshots([first, second])
    assert (merged["inference_count"], merged["execution_count"], merged["success_count"]) == (11, 3, 4)
    assert merged["batches"] == {3: [2, 2_000, 2_000, 2_000], 5: [1, 1_000, 1_000, 1_000]}
    assert merged["last_inference_ms"] == 100
    assert sum(merged["queue_histogram"]) == sum(merged["compute_histogram"]) == 4
    assert first["batches"] == {3: [1, 1_000, 1_000, 1_000]}  # the inputs are left as they were


MERGED_STATES = [
    ("all loaded and ready", [(True, 2), (True, 3)], (True, 5, [8, 32])),
    ("one still loading", [(True, 2), (False, None)], (False, 2, [8, 32])),
    ("none loaded", [(False, None), (False, None)], (False, None, [8, 32])),
]


@pytest.mark.parametrize(("name", "processes", "expected"), MERGED_STATES, ids=[case[0] for case in MERGED_STATES])
def test_the_states_of_a_pods_processes_merge_into_one(name, processes, expected):
    states = [{"outcomes": {"success": 1, "rejected": index, "failed": 0, "invalid": 2}, "pending": 1,
               "ready": ready, "stats": None if rows is None else _snapshot(1, rows, 0),
               "batch_limits": [8, 32] if index else [32]} for index, (ready, rows) in enumerate(processes)]
    merged = merge_states(states)
    ready, examples, limits = expected
    assert (merged["ready"], merged["batch_limits"], merged["pending"]) == (ready, limits, 2)
    assert merged["outcomes"] == {"success": 2, "rejected": 1, "failed": 0, "invalid": 4}
    assert (None if merged["stats"] is None else merged["stats"]["inference_count"]) == examples
