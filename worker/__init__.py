"""The worker: trainer, inference server, checkpoints, reporting. Never imports tandem.operator."""
