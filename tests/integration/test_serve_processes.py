"""`tandem serve --processes N` (an InferencePool's processesPerReplica): real `tandem serve` processes on real
sockets: a supervisor without torch that accepts and hands each connection to the next of N children, one stop for
all."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
from serving import (
    WAIT_S,
    inputs,
    json_body,
    listening_line,
    make_pool,
    ports_in,
    reference,
    request,
    serve_process,
    skip_without_c_front,
    wait_until,
)

from tandem.cli import main as cli_main
from tandem.worker import cores
from tandem.worker.serve.app import InferenceServer
from tandem.worker.serve.processes import (
    GRPC,
    HTTP,
    MEMBER,
    Dispatcher,
    Group,
    exit_description,
    listening_socket,
    new_group_directory,
    receive_connections,
)


def write_pool(tmp_path: Path, **spec) -> Path:
    manifest = tmp_path / "pool.json"
    manifest.write_text(json.dumps(make_pool(workersPerReplica=1, **spec).to_dict()))
    return manifest


def group_started(process: subprocess.Popen) -> tuple[int, int | None, list[int]]:
    """Waits for `tandem serve --processes 2` to be ready in both children; the HTTP and gRPC ports (None: no gRPC)
    and the children's pids, from the supervisor's line: `tandem serve: 2 processes listening on
    http://127.0.0.1:PORT and grpc://127.0.0.1:PORT (pids A, B)`."""
    lines: list[str] = []
    waiting = {"tandem serve: 2 processes listening on", "tandem serve [1/2]: ready", "tandem serve [2/2]: ready"}
    while waiting:
        line = process.stderr.readline()
        assert line, f"the log ended waiting for {sorted(waiting)}: {lines}"
        lines.append(line)
        waiting = {needle for needle in waiting if not line.startswith(needle)}
    [line] = [line for line in lines if "processes listening on" in line]
    pids = [int(pid) for pid in line.split("(pids ")[1].rstrip(")\n").split(", ")]
    return *ports_in(line), pids


def running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, waiting for whoever inherited it to reap it, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def group_directory(pid: int) -> Path:
    """A child's group directory, from the environment it was started with."""
    environment = dict(entry.split("=", 1) for entry in
                       Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in entry)
    return Path(json.loads(environment[MEMBER])["directory"])


def connections_held(pid: int, port: int) -> int:
    """How many established TCP connections to `port` process `pid` holds (its socket descriptors, matched against
    the kernel's TCP tables)."""
    accepted = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":  # 01: ESTABLISHED
                accepted.add(f"socket:[{fields[9]}]")
    held = 0
    for descriptor in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed since the listing
            held += os.readlink(descriptor) in accepted
    return held


def stop(process: subprocess.Popen, children: list[int]) -> None:
    """Whatever a failed test left running."""
    if process.poll() is None:
        process.kill()
        process.wait()
    for pid in children:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("http_front", ["python", "native"])
def test_two_processes_share_the_ports_answer_every_connection_and_stop_together(tmp_path, http_front):
    """The pool's processesPerReplica: 2, no flag: a supervisor that never loads torch and two children, both
    mapping one file of weights, served the connections in turn (half each, over HTTP, and over gRPC where the C
    front carries it; with the Python front each child's grpc.aio binds the gRPC port itself); a fresh
    connection each time, every request answered right; SIGTERM stops both (each drains), exit 0, nothing left
    behind. With either HTTP front (native: each child's C front takes the connections it is handed)."""
    skip_without_c_front(http_front)
    process = serve_process(write_pool(tmp_path, processesPerReplica=2, httpFront=http_front))
    pids: list[int] = []
    try:
        port, grpc_port, pids = group_started(process)
        assert len(set(pids)) == 2 and process.pid not in pids
        assert "libtorch" not in Path(f"/proc/{process.pid}/maps").read_text()
        directory = group_directory(pids[0])
        assert group_directory(pids[1]) == directory and directory.stat().st_mode & 0o777 == 0o700
        weights = str(directory / "weights-1.pt")  # the leader's, which both map: one copy in memory
        assert all(weights in Path(f"/proc/{pid}/maps").read_text() for pid in pids)
        x = inputs(32, seed=3)
        expected = reference(x)
        connections = []
        for row in range(len(x)):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
            connections.append(connection)
            connection.request("POST", "/v2/models/digits/infer", body=json_body(x[row:row + 1]))
            response = connection.getresponse()
            assert response.status == 200
            output = json.loads(response.read())["outputs"][0]["data"]
            np.testing.assert_allclose(output, expected[row], rtol=1e-5, atol=1e-6)
        assert [connections_held(pid, port) for pid in pids] == [16, 16]
        for connection in connections:
            connection.close()
        clients = [tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}",  # a connection each, not one shared
                                               channel_args=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(4)]
        tensor = tgrpc.InferInput("input", [4, 64], "FP32")
        tensor.set_data_from_numpy(x[:4])
        for client in clients:
            np.testing.assert_allclose(client.infer("digits", [tensor]).as_numpy("output"), expected[:4], rtol=1e-5,
                                       atol=1e-6)
        held = [connections_held(pid, grpc_port) for pid in pids]
        if http_front == "native":  # the supervisor hands the C fronts the connections in turn
            assert held == [2, 2]
        else:  # each child's grpc.aio binds the port itself (SO_REUSEPORT): the kernel spreads them by a hash
            assert sum(held) == 4
        for client in clients:
            client.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_S) == 0
    finally:
        stop(process, pids)
    log = process.stderr.read()
    assert "[1/2]: stopped" in log and "[2/2]: stopped" in log
    assert not any(running(pid) for pid in pids) and not directory.exists()


@pytest.mark.parametrize(("ended_by", "said"), [(signal.SIGKILL, "was killed by SIGKILL"),
                                                 (signal.SIGTERM, "exited with code 0")],
                         ids=["killed", "stopped-alone"])
def test_a_process_that_ends_on_its_own_stops_the_group_and_the_supervisor_exits_1(tmp_path, ended_by, said):
    """`--processes 2` on a pool of 1: one child killed (or stopped alone, drained: exit 0) while the group serves:
    the supervisor says which, the other drains and stops, and the supervisor exits 1 (the kubelet restarts the
    pod rather than leave it serving at half its capacity)."""
    process = serve_process(write_pool(tmp_path), "--processes", "2", "--no-grpc")
    pids: list[int] = []
    try:
        _, grpc_port, pids = group_started(process)
        assert grpc_port is None
        os.kill(pids[0], ended_by)
        assert process.wait(WAIT_S) == 1
    finally:
        stop(process, pids)
    log = process.stderr.read()
    assert f"process 1/2 (pid {pids[0]}) {said}: stopping the others" in log
    assert "[2/2]: stopping: not ready" in log and "[2/2]: stopped" in log
    assert not running(pids[1])


def test_a_supervisor_killed_outright_leaves_no_process_serving(tmp_path):
    """SIGKILL to the supervisor (it cannot forward anything): the kernel sends its children SIGTERM, and they
    drain and stop."""
    process = serve_process(write_pool(tmp_path), "--processes", "2", "--no-grpc")
    pids: list[int] = []
    try:
        _, _, pids = group_started(process)
        process.kill()
        wait_until(lambda: not any(running(pid) for pid in pids), what="both children stopped")
        log = process.stderr.read()
    finally:
        stop(process, pids)
    assert "[1/2]: stopped" in log and "[2/2]: stopped" in log


def test_one_process_is_todays_server_without_a_supervisor(tmp_path):
    """`--processes 1` overrides a pool's processesPerReplica: 2: one process serving alone, as before."""
    process = serve_process(write_pool(tmp_path, processesPerReplica=2), "--processes", "1")
    try:
        line = listening_line(process)
        assert line.startswith("tandem serve: listening on http://127.0.0.1:"), line
        port = int(line.split("http://127.0.0.1:")[1].split()[0])
        wait_until(lambda: request(port, "GET", "/v2/health/ready")[0] == 200, what="ready")
        assert request(port, "POST", "/v2/models/digits/infer", json_body(inputs(1)))[0] == 200
        assert Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text() == ""
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_S) == 0
    finally:
        stop(process, [])


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_bad_number_of_processes_is_refused_by_name(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exited:
        cli_main(["serve", str(write_pool(tmp_path)), "--processes", value])
    assert exited.value.code == 2
    assert f"argument --processes: {value!r} is not a number of processes: give a whole number, 1 or more" \
        in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_a_port_in_use_is_a_clear_error_and_exit_1(tmp_path, flag):
    """The supervisor binds the ports before it starts any process: a port taken is said, and nothing starts."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    try:
        process = serve_process(write_pool(tmp_path), "--processes", "2", flag, str(busy))
        assert process.wait(WAIT_S) == 1
    finally:
        taken.close()
    protocol = "HTTP" if flag == "--port" else "gRPC"
    assert process.stderr.read() == (f"tandem serve: cannot listen for {protocol} on 127.0.0.1:{busy}: "
                                     "[Errno 98] Address already in use\n")


class Receiver:
    """A child's side of the hand-over, on an event loop in this process: the connections it was handed, by what
    they are for."""

    def __init__(self, channel: socket.socket):
        self.received: list[tuple[bytes, socket.socket]] = []
        self.channel = channel

    def take(self, kind: bytes, connection: socket.socket) -> None:
        self.received.append((kind, connection))

    def payloads(self) -> list[tuple[bytes, bytes]]:
        """What each connection was for, and what its client sent on it."""
        read = []
        for kind, connection in self.received:
            with connection:
                connection.setblocking(True)
                read.append((kind, connection.recv(16)))
        return read


def test_the_supervisor_hands_connections_to_each_process_in_turn_per_port_and_passes_over_one_that_is_gone():
    """The Dispatcher and receive_connections over real sockets, one event loop standing for the supervisor and the
    children: 6 HTTP and 2 gRPC connections to 3 children go 2+2+2 and 1+1+0 (round robin per port); once a child's
    end is closed (it stopped), the others take its turns."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(3)]
    receivers = [Receiver(theirs) for _, theirs in pairs]
    http, grpc = listening_socket("127.0.0.1", 0, "HTTP"), listening_socket("127.0.0.1", 0, "gRPC")

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        for receiver in receivers:
            receive_connections(receiver.channel, {HTTP: lambda c, r=receiver: r.take(HTTP, c),
                                                   GRPC: lambda c, r=receiver: r.take(GRPC, c)})
        dispatcher = Dispatcher([ours for ours, _ in pairs])
        dispatcher.start(http, HTTP)
        dispatcher.start(grpc, GRPC)

        async def connect(listener: socket.socket, payload: bytes) -> None:
            count = sum(len(r.received) for r in receivers)
            _, writer = await asyncio.open_connection(*listener.getsockname())
            writer.write(payload)
            await writer.drain()
            while sum(len(r.received) for r in receivers) == count:  # handed over
                await asyncio.sleep(0.01)
            writer.close()

        for number in range(6):
            await connect(http, b"http %d" % number)
        for number in range(2):
            await connect(grpc, b"grpc %d" % number)
        loop.remove_reader(receivers[1].channel)
        receivers[1].channel.close()
        for number in range(6, 8):
            await connect(http, b"http %d" % number)
        dispatcher.stop()
        with pytest.raises(OSError):
            await asyncio.open_connection(*http.getsockname())

    try:
        asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()
    assert [r.payloads() for r in receivers] == [
        [(HTTP, b"http 0"), (HTTP, b"http 3"), (GRPC, b"grpc 0"), (HTTP, b"http 6")],
        [(HTTP, b"http 1"), (HTTP, b"http 4"), (GRPC, b"grpc 1")],
        [(HTTP, b"http 2"), (HTTP, b"http 5"), (HTTP, b"http 7")],
    ]


@pytest.mark.parametrize(("code", "said"), [
    (0, "exited with code 0"),
    (1, "exited with code 1"),
    (-signal.SIGKILL, "was killed by SIGKILL"),
    (-signal.SIGSEGV, "was killed by SIGSEGV"),
    (-99, "was killed by signal 99"),
])
def test_exit_description(code, said):
    assert exit_description(code) == said


@pytest.fixture
def torch_threads(monkeypatch):
    """Eight cores, no OMP_NUM_THREADS; torch's threads as they were afterwards."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cores, "available_cores", lambda: 8)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("workers", "group_size", "threads"), [
    (1, None, 8), (2, None, 4), (1, 2, 4), (2, 2, 2), (3, 4, 1),
])
def test_the_cores_are_shared_by_every_replica_of_the_group(torch_threads, tmp_path, workers, group_size, threads):
    group = None if group_size is None else Group(tmp_path, 0, group_size)
    InferenceServer(make_pool(workersPerReplica=workers), group=group)._share_cores()
    assert torch.get_num_threads() == threads


def test_a_group_directory_has_room_for_its_socket_paths(tmp_path, monkeypatch):
    """Under $TMPDIR, unless it is too deep for a Unix socket's path (as the emulated cluster's pods' is): then under
    /tmp."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    for temporary, parent in ((tmp_path, tmp_path), (deep, Path("/tmp"))):
        monkeypatch.setenv("TMPDIR", str(temporary))
        monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads $TMPDIR once, then keeps it
        directory = new_group_directory(2)
        try:
            assert directory.parent == parent and directory.stat().st_mode & 0o777 == 0o700
            assert len(bytes(Group(directory, 0, 2).socket_path(1))) < 108
        finally:
            directory.rmdir()
