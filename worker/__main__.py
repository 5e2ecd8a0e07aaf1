"""`python -m tandem.worker train` (one rank: tandem.worker.train.entrypoint), `python -m tandem.worker launch`
(a pod's several ranks: tandem.worker.train.launch) and `python -m tandem.worker coordinator` (an elastic job's store
and planner: tandem.worker.train.coordinator)."""

import sys

USAGE = ("usage: python -m tandem.worker train    (one rank, configured by RANK, WORLD_SIZE, ..., TANDEM_SPEC)\n"
         "       python -m tandem.worker launch   (a pod's ranks, configured by GROUP_RANK, LOCAL_WORLD_SIZE, ...)\n"
         "       python -m tandem.worker coordinator   (an elastic job's store, configured by MASTER_PORT, WORLD_SIZE, "
         "TANDEM_SPEC)")

if __name__ == "__main__":
    if sys.argv[1:] == ["launch"]:
        from tandem.worker.train.launch import launch

        sys.exit(launch())
    if sys.argv[1:] == ["coordinator"]:
        from tandem.worker.train.coordinator import cli

        sys.exit(cli())
    if sys.argv[1:] != ["train"]:
        sys.exit(USAGE)
    from tandem.worker.train.signals import block_stop_signals

    block_stop_signals()  # before torch starts any thread
    from tandem.worker.train.entrypoint import cli

    sys.exit(cli())
