"""Tandem: data-parallel PyTorch training and batched inference, locally or on Kubernetes.

The API models (the CRD schemas) live in :mod:`tandem.api`. The single-machine Python API
(``ParallelWrapper``, ``ParallelInference``) lives in the worker package and is imported on
first use, so importing ``tandem`` for its API models never pulls in torch.
"""

from importlib import import_module
from pathlib import Path

__version__ = "0.1.0"

_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "operator").is_dir():
    # Source checkout: tandem.operator is ../operator (pyproject's package-dir). It has no __init__.py, so
    # that `import operator` at the repo root still finds the standard library, and an editable install
    # cannot map such a namespace package below a regular one: let this package's path reach it.
    __path__.append(str(_CHECKOUT))

_LAZY_EXPORTS = {
    "ParallelWrapper": "tandem.worker.train.wrapper",
    "ParallelInference": "tandem.worker.serve.inference",
}


def __getattr__(name: str):
    if name in _LAZY_EXPORTS:
        return getattr(import_module(_LAZY_EXPORTS[name]), name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY_EXPORTS]
