"""The serving half of the worker: the inference server an InferencePool runs (`tandem serve`)."""
