"""Stop signals for worker processes: blocked before any thread starts, then taken by one thread.

This module imports nothing heavy, so entry points can block the signals before importing torch.
"""

import os
import signal
import sys
import threading

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def block_stop_signals() -> None:
    """Block SIGTERM and SIGINT in this thread; threads started afterwards inherit the block."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


class StopSignals:
    """SIGTERM / SIGINT, taken by one thread with sigwait, never by an interrupt handler: delivered to an arbitrary
    thread, a signal interrupts whatever system call torch's or gloo's threads are in. The process must have blocked
    them (`block_stop_signals`) before any thread started, so every thread inherits the block.

    Until a rank's context is attached (`attach`, once the rank has joined its group and built its model), a stop
    exits the process at once with 128 + the signal's number: there is nothing to checkpoint yet, and what the rank
    is doing (importing torch, waiting in the rendezvous for ranks that may never come) reads no flag, so a pod
    being deleted would otherwise wait for its whole grace period. Once attached, a stop sets
    `context.stop_requested`: all ranks agree on the step, write a checkpoint, exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._context = None
        block_stop_signals()
        threading.Thread(target=self._wait, name="tandem-stop-signals", daemon=True).start()

    def attach(self, context) -> None:
        with self._lock:
            self._context = context

    def _wait(self) -> None:
        while True:
            signum = signal.sigwait(STOP_SIGNALS)
            with self._lock:
                context = self._context
            if context is None:
                print(f"tandem worker: {signal.Signals(signum).name} before training started: nothing to checkpoint, "
                      "exiting", file=sys.stderr, flush=True)
                os._exit(128 + signum)
            context.stop_requested = True
