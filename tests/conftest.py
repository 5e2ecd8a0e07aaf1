"""Fixtures shared across tests/unit and tests/integration. The helper modules beside this file (distributed, jobs,
serving, userland, inference_models) are importable by name from any test: pyproject puts tests/ on the path."""

from __future__ import annotations

import pytest
from serving import Servers, make_pool, skip_without_c_front


@pytest.fixture
def served() -> Servers:
    """In-process inference servers on real sockets, each stopped after the test."""
    with Servers() as servers:
        yield servers


@pytest.fixture(scope="module", params=["python", "native"])
def http_front(request):
    """A module's tests, under both fronts (its `pytestmark` uses this fixture): the pools made by make_pool get
    httpFront python, then native (the C front answers the JSON inference requests and gRPC's ModelInfer with raw
    contents, and the Python server everything else)."""
    skip_without_c_front(request.param)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_TEST_HTTP_FRONT", request.param)
        yield request.param


@pytest.fixture(scope="module")
def fronts():
    """The same pool behind each front, HTTP and gRPC: {"python": server, "native": server} (the C front's tests
    send both the same requests and compare the answers)."""
    with Servers() as servers:
        yield {front: servers(make_pool(httpFront=front, workersPerReplica=1), grpc=True)
               for front in ("python", "native")}
