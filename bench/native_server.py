"""A server with no Python per request, to measure how much of the raw forward any server keeps on these cores:
a benchmark's instrument, not part of tandem (`bench_inference.py --only native` runs it beside `tandem serve`).

It is laid out as `tandem serve --processes N` with one worker each: a supervisor accepts the connections and deals
them out in turn over Unix sockets, and N processes each map the same weights file (one copy in memory) and run one
replica with one torch thread. In each process the request path is C (native_server.c, on the main thread, without
the GIL): HTTP, decoding a request's numbers, queueing, encoding and writing the answer. Python runs once per batch, on
the worker thread: take up to batchLimit queued examples, run the forward, give the outputs back. It serves exactly
the benchmark's request (see native_server.c); the model is the digits MLP.

    build(directory) -> the compiled module, or why it cannot be built here
    python bench/native_server.py --port 8000 --weights W.pt --module-dir DIR [--processes 2 --hidden 3072]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import traceback
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "native_server.c"
MODULE = "_native_server"


def build(directory: Path) -> Path | str:
    """Compile native_server.c into `directory`: the module's path, or (a str) why it cannot be built here."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    include = Path(sysconfig.get_paths()["include"])
    if compiler is None:
        return "no C compiler (cc) on PATH"
    if not (include / "Python.h").exists():
        return f"no Python headers at {include} (Debian: apt-get install python3-dev)"
    target = directory / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", f"-I{include}", str(SOURCE), "-o", str(target), "-lpthread"],
                   check=True)
    return target


def serve(channel: socket.socket, module_dir: str, weights: str, hidden: int, batch_limit: int) -> None:
    """One server process: the model, a worker thread, connections received on `channel`, the I/O loop here."""
    import torch

    sys.path.insert(0, module_dir)
    import _native_server as native

    from tandem.examples.digits import mlp

    torch.set_num_threads(1)
    model = mlp(hidden).eval()
    model.load_state_dict(torch.load(weights, mmap=True, weights_only=True), assign=True)

    def work() -> None:
        try:
            with torch.no_grad():
                while True:
                    taken = native.take(batch_limit)
                    if taken is not None:
                        examples, n, handle = taken
                        outputs = model(torch.frombuffer(examples, dtype=torch.float32).view(n, -1))
                        native.give(handle, outputs.numpy())
        except BaseException:  # a batch that cannot be answered: end, rather than leave its clients waiting
            traceback.print_exc()
            os._exit(1)

    def receive() -> None:
        while True:
            message, fds, _, _ = socket.recv_fds(channel, 1, 64)
            if not message:
                os._exit(0)  # the supervisor ended (the main thread never leaves the C loop to see a signal)
            for fd in fds:
                native.adopt(fd)

    threading.Thread(target=work, daemon=True).start()
    threading.Thread(target=receive, daemon=True).start()
    channel.send(b"r")
    native.run()


def supervise(port: int, processes: int, child_arguments: list[str]) -> None:
    """Start `processes` server processes; once all are ready, accept on `port` and deal connections in turn."""
    listener = socket.create_server(("127.0.0.1", port), backlog=1024)
    channels = []
    for _ in range(processes):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        subprocess.Popen([sys.executable, __file__, *child_arguments, "--channel-fd", str(theirs.fileno())],
                         pass_fds=(theirs.fileno(),))
        theirs.close()
        channels.append(mine)
    for channel in channels:
        if channel.recv(1) != b"r":
            raise SystemExit("a server process ended before it was ready")
    turn = 0
    while True:
        connection, _ = listener.accept()
        connection.setblocking(False)
        socket.send_fds(channels[turn % processes], [b"c"], [connection.fileno()])
        connection.close()
        turn += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--weights", required=True, help="the digits MLP's state dict (torch.save)")
    parser.add_argument("--module-dir", required=True, help="where build() put the compiled module")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--batch-limit", type=int, default=32)
    parser.add_argument("--channel-fd", type=int, help=argparse.SUPPRESS)  # a server process's, from the supervisor
    args = parser.parse_args()
    if args.channel_fd is not None:
        serve(socket.socket(fileno=args.channel_fd), args.module_dir, args.weights, args.hidden, args.batch_limit)
        return
    child = ["--port", str(args.port), "--weights", args.weights, "--module-dir", args.module_dir, "--hidden",
             str(args.hidden), "--batch-limit", str(args.batch_limit)]
    supervise(args.port, args.processes, child)


if __name__ == "__main__":
    main()
