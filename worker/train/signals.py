"""Stop signals for worker processes, blocked before any thread starts (see trainer.watch_stop_signals).

This module imports nothing heavy, so entry points can block the signals before importing torch.
"""

import signal

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def block_stop_signals() -> None:
    """Block SIGTERM and SIGINT in this thread; threads started afterwards inherit the block."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
