"""The serving half of the worker: the inference server an InferencePool runs (`tandem serve`). app.py puts it
together, and its docstring maps the other modules."""
