"""The C front (worker/serve/_front.c) is an optional extension: the package installs without it where it cannot be
built. Where it can (Linux with a C compiler, as here and in CI), its absence is an install that went wrong, not a
reason for its tests to skip."""

from __future__ import annotations

import shutil
import sys

import pytest

from tandem.worker.serve.native import UNAVAILABLE


@pytest.mark.skipif(sys.platform != "linux" or shutil.which("cc") is None,
                    reason="the C front needs Linux (epoll) and a C compiler")
def test_the_c_front_is_built_where_it_can_be():
    assert UNAVAILABLE is None


def test_the_front_leaves_to_the_python_server_what_it_cannot_write_as_it_is():
    """Names the front matches and writes without escapes; anything else (a checkpoint's input named with a quote,
    say) keeps the Python server alone, saying why."""
    from tandem.worker.serve.native import unavailable_reason
    from tandem.worker.serve.protocol import Signature, TensorSpec

    def loaded(input_name: str = "input", datatype: str = "FP32"):
        signature = Signature(TensorSpec(input_name, datatype, (64,)), TensorSpec("output", "FP32", (10,)), 32)
        return type("Loaded", (), {"signature": signature})()

    assert unavailable_reason(loaded(), "batched", "digits", "1") in (None, UNAVAILABLE)
    if UNAVAILABLE is None:
        assert "input name 'in\"put'" in unavailable_reason(loaded('in"put'), "batched", "digits", "1")
        assert "serves FP32 in and out" in unavailable_reason(loaded(datatype="INT64"), "sequential", "digits", "1")
        assert "inplace" in unavailable_reason(loaded(), "inplace", "digits", "1")

