"""Fixtures shared across tests/unit and tests/integration. The helper modules beside this file (distributed, jobs,
serving, userland, inference_models) are importable by name from any test: pyproject puts tests/ on the path."""

from __future__ import annotations

import pytest
from serving import Servers


@pytest.fixture
def served() -> Servers:
    """In-process inference servers on real sockets, each stopped after the test."""
    with Servers() as servers:
        yield servers
