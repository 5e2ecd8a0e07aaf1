"""The inference server's bearer token (worker/serve/auth.py): what it accepts and refuses, and a rotated token."""

from __future__ import annotations

import os

import pytest

from tandem.worker.serve.auth import AuthTokenError, BearerToken, path_needs_token, rpc_needs_token


@pytest.mark.parametrize(("authorization", "allowed"), [
    ("Bearer s3cret", True),
    ("bearer s3cret", True),
    ("Bearer  s3cret ", True),
    (b"Bearer s3cret", True),
    ("Bearer s3cre", False),
    ("Bearer s3cret-and-more", False),
    ("Basic s3cret", False),
    ("s3cret", False),
    ("", False),
    (None, False),
])
def test_only_the_bearer_token_is_allowed(tmp_path, authorization, allowed):
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    assert BearerToken(path).allows(authorization) is allowed


def test_a_rotated_token_replaces_the_old_one_and_a_missing_file_keeps_the_last(tmp_path):
    path = tmp_path / "token"
    path.write_text("old")
    token = BearerToken(path)
    path.write_text("new-token")
    os.utime(path, ns=(1, 10**18))  # a new mtime even on a coarse clock
    assert token.allows("Bearer new-token") and not token.allows("Bearer old")
    path.unlink()
    assert token.allows("Bearer new-token")


@pytest.mark.parametrize("content", [None, "  \n"])
def test_a_missing_or_empty_token_file_is_refused_naming_it(tmp_path, content):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(AuthTokenError, match=str(path)):
        BearerToken(path)


@pytest.mark.parametrize(("path", "metrics_protected", "needed"), [
    ("/v2/health/live", False, False),
    ("/v2/health/ready", True, False),
    ("/v2/models/digits/ready", False, False),
    ("/v2/models/digits/versions/1/ready", False, False),
    ("/metrics", False, False),
    ("/metrics", True, True),
    ("/v2/models/digits/infer", False, True),
    ("/v2/models/digits/versions/1/infer", False, True),
    ("/v2/models/digits", False, True),
    ("/v2/models/digits/config", False, True),
    ("/v2/models/digits/stats", False, True),
    ("/v2/models/stats", False, True),
    ("/v2", False, True),
    ("/v2/repository/index", False, True),
    ("/v2/repository/models/digits/load", False, True),
    ("/v2/models/digits/ready/more", False, True),
    ("/anything-else", False, True),
])
def test_which_http_paths_need_the_token(path, metrics_protected, needed):
    assert path_needs_token(path, metrics_protected) is needed


@pytest.mark.parametrize(("method", "needed"), [
    ("/inference.GRPCInferenceService/ServerLive", False),
    ("/inference.GRPCInferenceService/ServerReady", False),
    ("/inference.GRPCInferenceService/ModelReady", False),
    ("/inference.GRPCInferenceService/ModelInfer", True),
    ("/inference.GRPCInferenceService/ModelMetadata", True),
    ("/inference.GRPCInferenceService/ServerMetadata", True),
    ("/inference.GRPCInferenceService/ModelStatistics", True),
    ("/inference.GRPCInferenceService/RepositoryModelLoad", True),
    ("ModelInfer", True),
    ("ServerLive", False),
])
def test_which_grpc_methods_need_the_token(method, needed):
    assert rpc_needs_token(method) is needed
