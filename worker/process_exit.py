"""Leaving a worker process (a rank, an inference server) without interpreter teardown.

Threads that torch or gloo started, or a model's forward still running on a worker thread past a server's grace
period, can outlive the interpreter's teardown, and a C++ thread alive at that point aborts the process
("terminate called without an active exception"): a finished rank or a drained server would exit with SIGABRT
instead of its code. Both leave through here once their work and their output are done.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def exit_without_teardown(code: int) -> NoReturn:
    """Flush the standard streams and leave the process at once with `code`."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
