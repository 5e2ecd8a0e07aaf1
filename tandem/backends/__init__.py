"""Where a ParallelTrainingJob runs. `local`: processes on this machine (`tandem run`); the Kubernetes backend
is the operator (`tandem.operator`), which turns the same spec into pods."""
