"""`tandem serve --processes N` (an InferencePool's processesPerReplica): the pod's N server processes, started and
watched by a supervisor that imports no torch.

The supervisor binds the ports itself: N sockets on the HTTP address and N on the gRPC one (unless --no-grpc), each
with SO_REUSEPORT, so that the kernel spreads new connections over them. It then starts N children, each `tandem
serve` with the supervisor's own arguments: child i inherits its HTTP and gRPC sockets (pass_fds; the supervisor
closes its copies once they are started) and finds its place in $TANDEM_SERVE_MEMBER, a JSON object of the group's
directory, its index, the group's size, those sockets' file descriptors and the supervisor's pid
(`member_from_environment`). Each child is an InferenceServer with its Group, serving on the sockets it inherited
and talking to the others through group.py (which this module does not import: it imports torch). The group's
directory (mode 0700, for the processes' Unix sockets) lasts as long as the supervisor.

SIGTERM and SIGINT are forwarded to every child, which drains as a lone server does; the supervisor exits once they
all have, 0 when they all exit 0. A child that exits on its own (a crash, a kill, a model that cannot be loaded)
stops the group: the others are sent SIGTERM and drain, and the supervisor exits 1, so that the kubelet restarts
the container rather than the pod serving at part of its capacity without saying so. On Linux a child is also sent
SIGTERM when the supervisor dies (PR_SET_PDEATHSIG): a supervisor killed outright leaves no process serving.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tandem.serve")

MEMBER = "TANDEM_SERVE_MEMBER"
BACKLOG = 1024  # as http.py's
PR_SET_PDEATHSIG = 1  # prctl(2)
SOCKET_PATH_BYTES = 108  # sun_path, with its terminating NUL


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
    """A child's place in its group, and the sockets it serves on (gRPC: None with --no-grpc)."""

    group: Group
    http: socket.socket
    grpc: socket.socket | None


def member_from_environment() -> Member | None:
    """This process's place in a group when a supervisor started it, else None; a member stops (SIGTERM) when its
    supervisor dies. Read once: the variable is removed, so that nothing this process starts takes itself for a
    member."""
    value = os.environ.pop(MEMBER, None)
    if value is None:
        return None
    fields = json.loads(value)
    _stop_with(fields["supervisor"])
    grpc = None if fields["grpc_fd"] is None else socket.socket(fileno=fields["grpc_fd"])
    group = Group(Path(fields["directory"]), fields["index"], fields["size"])
    return Member(group, socket.socket(fileno=fields["http_fd"]), grpc)


def _stop_with(supervisor: int) -> None:
    if sys.platform != "linux":
        return
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != supervisor:  # it died before the request
        os.kill(os.getpid(), signal.SIGTERM)


def listening_sockets(host: str, port: int, count: int, protocol: str) -> list[socket.socket]:
    """`count` sockets listening on host:port, all with SO_REUSEPORT (port 0: the first takes a free port, the
    others the same). Raises OSError naming the protocol, the address and the reason."""
    sockets: list[socket.socket] = []
    try:
        family, kind, number, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        for _ in range(count):
            listener = socket.socket(family, kind, number)
            sockets.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            listener.bind(address)
            listener.listen(BACKLOG)
            address = listener.getsockname()
    except OSError as error:
        for listener in sockets:
            listener.close()
        raise OSError(f"cannot listen for {protocol} on {host}:{port}: {error}") from error
    return sockets


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


def supervise(arguments: list[str], host: str, port: int, grpc_port: int | None, size: int) -> int:
    """Serve as `size` processes of `tandem ARGUMENTS` on host:port (and grpc_port, unless None) until SIGTERM or
    SIGINT, or until one of them exits; the supervisor's exit code (1 as well when a port cannot be listened on)."""
    try:
        sockets = _group_sockets(host, port, grpc_port, size)
    except OSError as error:
        log.error("%s", error)
        return 1
    directory = new_group_directory(size)
    try:
        return asyncio.run(_run_group(arguments, directory, host, sockets))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _group_sockets(host: str, port: int, grpc_port: int | None,
                   size: int) -> list[tuple[socket.socket, socket.socket | None]]:
    """Each process's HTTP and gRPC sockets."""
    http = listening_sockets(host, port, size, "HTTP")
    try:
        grpc = [None] * size if grpc_port is None else listening_sockets(host, grpc_port, size, "gRPC")
    except OSError:
        for listener in http:
            listener.close()
        raise
    return list(zip(http, grpc, strict=True))


async def _run_group(arguments: list[str], directory: Path, host: str,
                     sockets: list[tuple[socket.socket, socket.socket | None]]) -> int:
    size = len(sockets)
    first_http, first_grpc = sockets[0]
    address = f"http://{host}:{first_http.getsockname()[1]}"
    if first_grpc is not None:
        address += f" and grpc://{host}:{first_grpc.getsockname()[1]}"
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
            for index, (http, grpc) in enumerate(sockets):
                children.append(await _start_child(arguments, Member(Group(directory, index, size), http, grpc)))
        finally:
            for listeners in sockets:
                for listener in listeners:
                    if listener is not None:
                        listener.close()
        if stop.is_set():
            signal_all(signal.SIGTERM)  # for the children started after the signal
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
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()


async def _start_child(arguments: list[str], member: Member) -> asyncio.subprocess.Process:
    group = member.group
    fields = {"directory": str(group.directory), "index": group.index, "size": group.size,
              "http_fd": member.http.fileno(), "grpc_fd": None if member.grpc is None else member.grpc.fileno(),
              "supervisor": os.getpid()}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tandem.cli", *arguments, env={**os.environ, MEMBER: json.dumps(fields)},
        pass_fds=[listener.fileno() for listener in (member.http, member.grpc) if listener is not None])
