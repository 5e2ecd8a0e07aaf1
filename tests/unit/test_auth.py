"""The inference server's bearer token (worker/serve/auth.py): what it accepts and refuses, and a rotated token."""

from __future__ import annotations

import os

import pytest

from tandem.worker.serve.auth import AuthTokenError, BearerToken


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
