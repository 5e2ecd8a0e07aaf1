"""`tandem serve --processes N` (an InferencePool's processesPerReplica): the pod's N server processes, started and
watched by a supervisor that imports no torch.

The supervisor listens on the HTTP port itself, and on the gRPC port (unless --no-grpc) where the children's C front
carries it (`front_carries_grpc`: httpFront native, the front built, not inplace), accepts every connection and hands
it to the children in turn (`Dispatcher`: round robin per port, the connection's descriptor sent over a Unix socket
pair, SCM_RIGHTS), as Node.js's cluster module does: with SO_REUSEPORT the kernel spread connections by a hash of
their addresses, and 8 connections landed 5 and 3 or 6 and 2 as often as 4 and 4, so one process ran short
batches while the other queued (measured in bench/RESULTS.md). grpc.aio, which serves gRPC where the front does not,
cannot adopt a connection accepted elsewhere: then the supervisor only reserves the gRPC port (bound with
SO_REUSEPORT, not listening, so a port in use is still an error here) and each child's grpc.aio binds it too with
SO_REUSEPORT (grpc's default), the kernel spreading the connections by their addresses' hash. It then starts N
children, each `tandem serve`
with the supervisor's own arguments: child i inherits its end of its socket pair (pass_fds) and finds its place in
$TANDEM_SERVE_MEMBER, a JSON object of the group's directory, its index, the group's size, that descriptor, the
ports and the supervisor's pid (`member_from_environment`). Each child is an InferenceServer with its Group,
serving the connections it is handed (`receive_connections`) and talking to the others through group.py (which
this module does not import: it imports torch). The group's directory (mode 0700, for the processes' Unix
sockets) lasts as long as the supervisor.

SIGTERM and SIGINT are forwarded to every child, which drains as a lone server does (a connection handed to a child
that has stopped is closed); the supervisor exits once they all have, 0 when they all exit 0. A child that exits on
its own (a crash, a kill, a model that cannot be loaded) stops the group: the others are sent SIGTERM and drain,
and the supervisor exits 1, so that the kubelet restarts the container rather than the pod serving at part of its
capacity without saying so. On Linux a child is also sent SIGTERM when the supervisor dies (PR_SET_PDEATHSIG): a
supervisor killed outright leaves no process serving.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tandem.serve")

MEMBER = "TANDEM_SERVE_MEMBER"
BACKLOG = 1024  # as http.py's
PR_SET_PDEATHSIG = 1  # prctl(2)
SOCKET_PATH_BYTES = 108  # sun_path, with its terminating NUL
HTTP, GRPC = b"h", b"g"  # what a connection handed over is for: the message its descriptor comes with


@dataclass(frozen=True)
class HandedOver:
    """Connections to `port` accepted by another process and handed over (a process group's supervisor,
    processes.py): the server listens on nothing and serves what its `adopt` is given."""

    port: int


Listen = int | HandedOver
"""Where a server listens: a port (0: any free port), or nowhere (HandedOver)."""

@dataclass(frozen=True)
class Group:
    """One server process's place in its pod's group: `index` of `size`, sharing `directory` (mode 0700) with the
    others, where each listens on a Unix socket for its peers (group.py)."""

    directory: Path
    index: int
    size: int

    def socket_path(self, index: int) -> Path:
        """Where process `index` listens for its peers."""
        return self.directory / f"peer-{index}.sock"

    @property
    def leader(self) -> bool:
        """Process 0 makes the group's changes and follows the training job's checkpoints for it."""
        return self.index == 0


@dataclass(frozen=True)
class Member:
    """A child's place in its group, the socket its connections are handed over on, and the ports they come to
    (gRPC: None with --no-grpc)."""

    group: Group
    channel: socket.socket
    http_port: int
    grpc_port: int | None
    grpc_handed_over: bool = True
    """The supervisor accepts the gRPC port's connections and hands them over; else each member binds the port."""


def member_from_environment() -> Member | None:
    """This process's place in a group when a supervisor started it, else None; a member stops (SIGTERM) when its
    supervisor dies. Read once: the variable is removed, so that nothing this process starts takes itself for a
    member."""
    value = os.environ.pop(MEMBER, None)
    if value is None:
        return None
    fields = json.loads(value)
    _stop_with(fields["supervisor"])
    group = Group(Path(fields["directory"]), fields["index"], fields["size"])
    return Member(group, socket.socket(fileno=fields["channel_fd"]), fields["http_port"], fields["grpc_port"],
                  fields["grpc_handed_over"])


def receive_connections(channel: socket.socket, adopt: dict[bytes, Callable[[socket.socket], None]]) -> None:
    """On the running event loop, from now on: each connection the supervisor hands over on `channel` goes to
    adopt[what it is for] (HTTP or GRPC)."""
    loop = asyncio.get_running_loop()
    channel.setblocking(False)

    def readable() -> None:
        while True:
            try:
                kind, descriptors, _, _ = socket.recv_fds(channel, 1, 1)
            except (BlockingIOError, InterruptedError):
                return
            if not kind:  # the supervisor closed its end
                loop.remove_reader(channel)
                return
            for descriptor in descriptors:
                connection = socket.socket(fileno=descriptor)
                take = adopt.get(kind)
                if take is None:
                    connection.close()
                else:
                    take(connection)

    loop.add_reader(channel, readable)


def _stop_with(supervisor: int) -> None:
    if sys.platform != "linux":
        return
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != supervisor:  # it died before the request
        os.kill(os.getpid(), signal.SIGTERM)


def front_carries_grpc(http_front: str, inference_mode: str) -> bool:
    """Whether a server's C front will own its gRPC port's connections (native.py), known before any model loads and
    without importing it: asked for (httpFront native), built, and the inference mode not inplace."""
    return http_front == "native" and inference_mode != "inplace" and \
        importlib.util.find_spec("tandem.worker.serve._front") is not None


def listening_socket(host: str, port: int, protocol: str, listen: bool = True) -> socket.socket:
    """A non-blocking socket listening on host:port (0: a free port); `listen` False: only bound, with SO_REUSEPORT,
    holding the port for processes that bind it so too. Raises OSError naming the protocol, the address and the
    reason."""
    listener = None
    try:
        family, kind, number, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, kind, number)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if not listen:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(address)
        if listen:
            listener.listen(BACKLOG)
        listener.setblocking(False)
    except OSError as error:
        if listener is not None:
            listener.close()
        raise OSError(f"cannot listen for {protocol} on {host}:{port}: {error}") from error
    return listener


def accept_on(listener: socket.socket, take: Callable[[socket.socket], None]) -> None:
    """On the running event loop, from now on: each connection accepted on `listener` goes to take(connection)."""

    def accept() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # out of descriptors, say: the connection waits in the backlog
                log.warning("cannot accept a connection: %s", error)
                return
            take(connection)

    asyncio.get_running_loop().add_reader(listener, accept)


class Dispatcher:
    """The supervisor's side: accepts on its listening sockets (on the running event loop) and hands each connection
    to the next child in turn, per socket, over the children's `channels`; a child that cannot take one (stopped, or
    not reading) is passed over for the next."""

    def __init__(self, channels: list[socket.socket]):
        self.channels = channels
        self.listeners: list[socket.socket] = []
        self._turns: dict[bytes, int] = {}

    def start(self, listener: socket.socket, kind: bytes) -> None:
        self.listeners.append(listener)
        accept_on(listener, lambda connection: self._hand_over(connection, kind))

    def stop(self) -> None:
        """Stop accepting (new connections are refused) and close the listening sockets."""
        loop = asyncio.get_running_loop()
        for listener in self.listeners:
            loop.remove_reader(listener)
            listener.close()
        self.listeners.clear()

    def _hand_over(self, connection: socket.socket, kind: bytes) -> None:
        with connection:  # the child served has its own copy
            self._send(connection, kind)

    def _send(self, connection: socket.socket, kind: bytes) -> None:
        turn = self._turns.get(kind, 0)
        for offset in range(len(self.channels)):
            index = (turn + offset) % len(self.channels)
            try:
                socket.send_fds(self.channels[index], [kind], [connection.fileno()])
            except OSError:
                continue
            self._turns[kind] = index + 1
            return
        log.warning("no server process could take a connection: closed")


def new_group_directory(size: int) -> Path:
    """A new private directory (mode 0700) for a group of `size`: under $TMPDIR, or under /tmp where $TMPDIR is so
    deep that a peer's socket path there would pass the length a Unix socket's path may have."""
    for parent in (None, "/tmp"):
        directory = Path(tempfile.mkdtemp(prefix="tandem-serve-", dir=parent))
        if len(bytes(Group(directory, 0, size).socket_path(size - 1))) < SOCKET_PATH_BYTES:
            return directory
        directory.rmdir()
    raise OSError(f"no directory for the server processes' sockets: {directory} is too deep for a Unix socket's path")


def exit_description(code: int) -> str:
    """A child's exit as a person says it (a negative code is the signal that ended it, as subprocess has it)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def supervise(arguments: list[str], host: str, port: int, grpc_port: int | None, size: int,
              hand_grpc_over: bool = True) -> int:
    """Serve as `size` processes of `tandem ARGUMENTS` on host:port (and grpc_port, unless None) until SIGTERM or
    SIGINT, or until one of them exits; the supervisor's exit code (1 as well when a port cannot be listened on).
    `hand_grpc_over`: the children's C front carries gRPC, so the supervisor accepts on its port too; else it only
    reserves the port, which each child's grpc.aio binds."""
    try:
        http = listening_socket(host, port, "HTTP")
    except OSError as error:
        log.error("%s", error)
        return 1
    try:
        grpc = None if grpc_port is None else listening_socket(host, grpc_port, "gRPC", listen=hand_grpc_over)
    except OSError as error:
        http.close()
        log.error("%s", error)
        return 1
    directory = new_group_directory(size)
    try:
        return asyncio.run(_run_group(arguments, directory, host, size, http, grpc, hand_grpc_over))
    finally:
        http.close()
        if grpc is not None:
            grpc.close()
        shutil.rmtree(directory, ignore_errors=True)


async def _run_group(arguments: list[str], directory: Path, host: str, size: int, http: socket.socket,
                     grpc: socket.socket | None, hand_grpc_over: bool) -> int:
    http_port = http.getsockname()[1]
    grpc_port = None if grpc is None else grpc.getsockname()[1]
    address = f"http://{host}:{http_port}" + ("" if grpc_port is None else f" and grpc://{host}:{grpc_port}")
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(size)]
    for ours, _ in pairs:
        ours.setblocking(False)
    dispatcher = Dispatcher([ours for ours, _ in pairs])
    children: list[asyncio.subprocess.Process] = []
    stop = asyncio.Event()

    def signal_all(signum: int) -> None:
        for child in children:
            if child.returncode is None:
                child.send_signal(signum)

    def forward(signum: int) -> None:
        stop.set()
        signal_all(signum)

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, forward, signum)
    try:
        try:
            for index, (_, theirs) in enumerate(pairs):
                member = Member(Group(directory, index, size), theirs, http_port, grpc_port, hand_grpc_over)
                children.append(await _start_child(arguments, member))
        finally:
            for _, theirs in pairs:
                theirs.close()
        if stop.is_set():
            signal_all(signal.SIGTERM)  # for the children started after the signal
        dispatcher.start(http, HTTP)
        if grpc is not None and hand_grpc_over:
            dispatcher.start(grpc, GRPC)
        log.info("%d processes listening on %s (pids %s)", size, address,
                 ", ".join(str(child.pid) for child in children))
        exits = {asyncio.ensure_future(child.wait()): index for index, child in enumerate(children)}
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([stopping, *exits], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        failed = not stop.is_set()
        if failed:
            index = next(exits[task] for task in exits if task.done())
            log.error("process %d/%d (pid %d) %s: stopping the others (a pod serves whole or not at all)", index + 1,
                      size, children[index].pid, exit_description(children[index].returncode))
            signal_all(signal.SIGTERM)
        codes = await asyncio.gather(*exits)
        return 1 if failed or any(codes) else 0
    finally:
        dispatcher.stop()
        for ours, _ in pairs:
            ours.close()
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()


async def _start_child(arguments: list[str], member: Member) -> asyncio.subprocess.Process:
    group = member.group
    fields = {"directory": str(group.directory), "index": group.index, "size": group.size,
              "channel_fd": member.channel.fileno(), "http_port": member.http_port, "grpc_port": member.grpc_port,
              "grpc_handed_over": member.grpc_handed_over, "supervisor": os.getpid()}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tandem.cli", *arguments, env={**os.environ, MEMBER: json.dumps(fields)},
        pass_fds=[member.channel.fileno()])
