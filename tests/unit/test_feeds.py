"""The batching engine alone: ParallelInference taking its batches from two feeds in process, its own queue and a
second Feed written here (as a front outside the interpreter keeps one), with no front and no server. Requests are
held at a known point with a gate (inference_models.Gate) and the outcomes asserted: which requests shared each
forward, in what order, and what each was answered; never how long anything took."""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future

import pytest
import torch
from inference_models import GATES, POISON, Forward, gated_mlp, recorder

from tandem import ParallelInference
from tandem.worker.serve.batching import Ticket
from tandem.worker.serve.inference import InferenceTimeout, ModelError, QueueFullError

torch.set_num_threads(1)
F32, F64 = torch.float32, torch.float64
SIDE_KEY = (torch.Size([4]), F32)


class SideFeed:
    """A second Feed, kept as a front outside the interpreter keeps its queue: requests of one key, taken oldest
    first as a run that fits; its own queue limit, counting the other feeds' requests it is told of (`others`);
    `want` met by waking ParallelInference from the submitting thread; requests past their deadline handed back to
    be answered."""

    def __init__(self, queue_limit: int = 64):
        self.key = SIDE_KEY
        self.queue_limit = queue_limit
        self.inference: ParallelInference | None = None
        self.lock = threading.Lock()
        self.tickets: deque[Ticket] = deque()
        self.wanted = 0
        self.others_held = 0

    def submit(self, x: torch.Tensor, callback, timeout: float | None = None) -> Ticket:
        ticket = Ticket(x, callback, None if timeout is None else time.monotonic() + timeout, self)
        assert ticket.key == self.key, ticket.key
        with self.lock:
            if len(self.tickets) + self.others_held >= self.queue_limit:
                raise QueueFullError("the side feed is full")
            self.tickets.append(ticket)
            wake = self.wanted and sum(t.rows for t in self.tickets) >= self.wanted
            if wake:
                self.wanted = 0
        if wake:
            self.inference.wake()
        return ticket

    def queued(self) -> tuple[int, int, int]:
        with self.lock:
            oldest = self.tickets[0].submitted if self.tickets else 0
            return sum(t.rows for t in self.tickets), len(self.tickets), oldest

    def take(self, max_rows: int, max_requests: int, key) -> tuple[list[Ticket], list[Ticket]]:
        now = time.monotonic()
        taken: list[Ticket] = []
        expired: list[Ticket] = []
        rows = 0
        with self.lock:
            if key not in (None, self.key):
                return [], []
            while self.tickets and len(taken) < max_requests and rows < max_rows:
                ticket = self.tickets[0]
                if ticket.deadline is not None and now > ticket.deadline:
                    expired.append(self.tickets.popleft())
                    continue
                if rows + ticket.rows > max_rows and (taken or key is not None):
                    break
                taken.append(self.tickets.popleft())
                rows += ticket.rows
        return taken, expired

    def want(self, rows: int) -> None:
        with self.lock:
            self.wanted = rows

    def others(self, requests: int) -> None:
        with self.lock:
            self.others_held = requests


@pytest.fixture
def gate(request):
    """A fresh gate named after the test, with a Recorder behind it (answers each row with its request id)."""
    name = request.node.name
    GATES.pop(name, None)
    model = recorder(name)
    yield model, GATES[name]
    GATES[name].open.set()


def _engine(model, side: SideFeed, **options) -> ParallelInference:
    inference = ParallelInference(model, workers=1, **options)
    side.inference = inference
    inference.attach(side)
    return inference


def _ask(inference: ParallelInference, side: SideFeed, where: str, request_id: int, shape=(4,), dtype=F32,
         rows: int = 1, timeout: float | None = None) -> tuple[Future, Ticket]:
    """Queue a request whose every value is `request_id` in `where` ("own": ParallelInference's queue, or "side");
    the future of its answer, and its ticket."""
    x = torch.full((rows, *shape), request_id, dtype=dtype)
    answered: Future = Future()

    def answer(output, error):
        if error is not None:
            answered.set_exception(error)
        else:
            answered.set_result(output)

    ticket = (inference.submit if where == "own" else side.submit)(x, answer, timeout)
    return answered, ticket


def _hold(inference: ParallelInference, side: SideFeed, gate) -> Future:
    """Close the gate and send request 1 (its forward waits at the gate: the worker is busy)."""
    gate.close()
    running, _ = _ask(inference, side, "own", 1)
    gate.wait_entered(1)
    return running


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached")
        time.sleep(0.002)


HELD = Forward((1,), (4,), F32)
# (mode, batch_limit, requests queued behind the held one: (feed, id, options), the forwards after the held one)
BATCHES = {
    "oldest first across feeds, one request a forward": (
        "batched", 1, [("own", 2, {}), ("side", 3, {}), ("side", 4, {}), ("own", 5, {})],
        [Forward((i,), (4,), F32) for i in (2, 3, 4, 5)]),
    "sequential mode: one request a forward, oldest first": (
        "sequential", 8, [("side", 2, {}), ("own", 3, {}), ("own", 4, {}), ("side", 5, {})],
        [Forward((i,), (4,), F32) for i in (2, 3, 4, 5)]),
    "a batch filled across feeds, the oldest request's feed first": (
        "batched", 8, [("own", 2, {}), ("side", 3, {}), ("own", 4, {}), ("side", 5, {})],
        [Forward((2, 4, 3, 5), (4,), F32)]),
    "the side feed's oldest starts the batch": (
        "batched", 8, [("side", 2, {}), ("own", 3, {}), ("side", 4, {}), ("own", 5, {})],
        [Forward((2, 4, 3, 5), (4,), F32)]),
    "filled up to the batch limit, the rest next": (
        "batched", 3, [("own", 2, {}), ("side", 3, {}), ("own", 4, {}), ("side", 5, {})],
        [Forward((2, 4, 3), (4,), F32), Forward((5,), (4,), F32)]),
    "another dtype is not mixed in": (
        "batched", 8, [("own", 2, {"dtype": F64}), ("side", 3, {}), ("own", 4, {})],
        [Forward((2,), (4,), F64), Forward((3, 4), (4,), F32)]),
    "another shape is not mixed in": (
        "batched", 8, [("side", 2, {}), ("own", 3, {"shape": (2, 2)}), ("own", 4, {})],
        [Forward((2, 4), (4,), F32), Forward((3,), (2, 2), F32)]),
    "a request over the limit runs alone": (
        "batched", 2, [("side", 2, {"rows": 3}), ("own", 3, {})],
        [Forward((2, 2, 2), (4,), F32), Forward((3,), (4,), F32)]),
}


@pytest.mark.parametrize(("mode", "batch_limit", "asks", "forwards"), BATCHES.values(), ids=BATCHES.keys())
def test_batches_are_taken_from_both_feeds(gate, mode, batch_limit, asks, forwards):
    model, gate = gate
    side = SideFeed()
    with _engine(model, side, mode=mode, batch_limit=batch_limit) as inference:
        answers = [_hold(inference, side, gate)]
        answers += [_ask(inference, side, where, request_id, **options)[0] for where, request_id, options in asks]
        gate.open.set()
        outputs = [answer.result(60) for answer in answers]
    assert gate.forwards == [HELD, *forwards]
    for (_, request_id, _), output in zip([("own", 1, {}), *asks], outputs, strict=True):
        assert (output == request_id).all(), (request_id, output)


def test_the_queue_limit_counts_both_feeds(gate):
    model, gate = gate
    side = SideFeed(queue_limit=3)
    with _engine(model, side, queue_limit=3) as inference:
        answers = [_hold(inference, side, gate)]
        answers += [_ask(inference, side, where, i)[0] for where, i in (("own", 2), ("side", 3), ("own", 4))]
        assert inference.queued == 3
        with pytest.raises(QueueFullError, match=r"^queue full: 3 requests already waiting \(queue_limit=3\); "
                                                 r"retry later$"):
            _ask(inference, side, "own", 5)
        with pytest.raises(QueueFullError, match="side feed is full"):  # told of the own queue's two
            _ask(inference, side, "side", 6)
        gate.open.set()
        assert [int(answer.result(60)[0, 0]) for answer in answers] == [1, 2, 3, 4]
    assert inference.stats.snapshot()["rejected_count"] == 1


def test_a_side_feeds_want_wakes_a_worker_waiting_for_requests(gate):
    model, _ = gate
    side = SideFeed()
    with _engine(model, side) as inference:
        _wait_until(lambda: side.wanted == 1, "the idle worker's want")
        answer, _ = _ask(inference, side, "side", 7)
        assert (answer.result(60) == 7).all()


# (the feed of the first request, the feed that brings the batch to its limit, the side feed's want meanwhile)
FILLS = {"own, then own": ("own", "own", 3), "own, then side": ("own", "side", 3),
         "side, then own": ("side", "own", 4), "side, then side": ("side", "side", 4)}


@pytest.mark.parametrize(("first", "then", "side_wants"), FILLS.values(), ids=FILLS.keys())
def test_a_feed_that_fills_the_batch_wakes_a_worker_waiting_out_max_delay(gate, first, then, side_wants):
    """max_delay_us is ten minutes: the batch goes when a feed's want is met, not when the delay ends."""
    model, gate = gate
    side = SideFeed()
    with _engine(model, side, batch_limit=4, max_delay_us=600_000_000) as inference:
        answers = [_ask(inference, side, first, 2)[0]]
        _wait_until(lambda: side.wanted == side_wants, "the waiting worker's want")
        answers += [_ask(inference, side, then, i)[0] for i in (3, 4, 5)]
        outputs = [answer.result(60) for answer in answers]
    assert gate.forwards == [Forward((2, 3, 4, 5), (4,), F32)]
    assert [int(output[0, 0]) for output in outputs] == [2, 3, 4, 5]


@pytest.mark.parametrize("expiring", ["own", "side"])
def test_a_request_past_its_deadline_in_either_feed_is_answered_with_the_timeout(gate, expiring):
    model, gate = gate
    side = SideFeed()
    other = "side" if expiring == "own" else "own"
    with _engine(model, side) as inference:
        running = _hold(inference, side, gate)
        late, ticket = _ask(inference, side, expiring, 2, timeout=0.001)
        live, _ = _ask(inference, side, other, 3)
        _wait_until(lambda: time.monotonic() > ticket.deadline, "the deadline")
        gate.open.set()
        with pytest.raises(InferenceTimeout, match="timed out after waiting"):
            late.result(60)
        assert (live.result(60) == 3).all() and (running.result(60) == 1).all()
    assert gate.forwards == [HELD, Forward((3,), (4,), F32)]
    assert inference.stats.snapshot()["fail_count"] == 1


def test_a_failed_batch_across_feeds_is_retried_one_request_at_a_time():
    GATES.pop("split", None)
    model = gated_mlp("split")
    gate = GATES["split"]
    side = SideFeed()
    side.key = (torch.Size([64]), F32)
    try:
        with _engine(model, side) as inference:
            gate.close()
            running, _ = _ask(inference, side, "own", 1, shape=(64,))
            gate.wait_entered(1)
            good, _ = _ask(inference, side, "own", 2, shape=(64,))
            bad, _ = _ask(inference, side, "side", POISON, shape=(64,))
            gate.open.set()
            assert running.result(60).shape == good.result(60).shape == (1, 10)
            with pytest.raises(ModelError, match="poisoned"):
                bad.result(60)
    finally:
        gate.open.set()
    assert gate.batches == [1, 2, 1, 1]


def test_shutdown_drains_its_own_queue_and_leaves_a_feeds_requests_to_the_feed(gate):
    model, gate = gate
    side = SideFeed()
    inference = _engine(model, side)
    running = _hold(inference, side, gate)
    own, _ = _ask(inference, side, "own", 2)
    _ask(inference, side, "side", 3)
    stopping = threading.Thread(target=inference.shutdown)
    stopping.start()
    _wait_until(lambda: inference.closed, "shut down")
    gate.open.set()
    stopping.join(60)
    assert not stopping.is_alive()
    assert (running.result(60) == 1).all() and (own.result(60) == 2).all()
    assert side.queued()[1] == 1  # the front answers its own (NativeFront.stop)
