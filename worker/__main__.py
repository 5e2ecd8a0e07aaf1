"""`python -m tandem.worker train`: the worker entry point (see tandem.worker.train.entrypoint)."""

import sys

from tandem.worker.train.signals import block_stop_signals

block_stop_signals()  # before torch starts any thread

from tandem.worker.train.entrypoint import cli  # noqa: E402

if __name__ == "__main__":
    if sys.argv[1:] != ["train"]:
        sys.exit("usage: python -m tandem.worker train   (configured by RANK, WORLD_SIZE, ..., TANDEM_SPEC)")
    sys.exit(cli())
