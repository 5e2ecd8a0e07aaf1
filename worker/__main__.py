"""`python -m tandem.worker train`: the worker entry point (see tandem.worker.entrypoint)."""

import sys

from tandem.worker.entrypoint import cli

if __name__ == "__main__":
    if sys.argv[1:] != ["train"]:
        sys.exit("usage: python -m tandem.worker train   (configured by RANK, WORLD_SIZE, ..., TANDEM_SPEC)")
    sys.exit(cli())
