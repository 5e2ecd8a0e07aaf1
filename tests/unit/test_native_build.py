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
