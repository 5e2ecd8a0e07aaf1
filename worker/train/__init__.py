"""The training half of the worker: one rank of a ParallelTrainingJob (`tandem worker train`)."""
