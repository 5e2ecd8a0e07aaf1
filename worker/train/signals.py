"""Stop signals for worker processes: blocked before any thread starts, then taken by one thread.

This module imports nothing heavy, so entry points can block the signals before importing torch.
"""

import signal
import threading

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def block_stop_signals() -> None:
    """Block SIGTERM and SIGINT in this thread; threads started afterwards inherit the block."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def watch_stop_signals(context) -> None:
    """SIGTERM / SIGINT set `context.stop_requested`: all ranks agree on the step, write a checkpoint, exit.

    The signals are taken by one thread with sigwait, never by an interrupt handler: delivered to an arbitrary
    thread, a signal interrupts whatever system call torch's or gloo's threads are in. The process must have
    blocked them (`block_stop_signals`) before any thread started, so every thread inherits the block.
    """

    def wait_for_signals() -> None:
        while True:
            signal.sigwait(STOP_SIGNALS)
            context.stop_requested = True

    block_stop_signals()
    threading.Thread(target=wait_for_signals, name="tandem-stop-signals", daemon=True).start()
