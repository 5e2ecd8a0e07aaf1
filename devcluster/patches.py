"""PATCH bodies by content type, as the API server applies them.

- `application/merge-patch+json` (RFC 7386): dicts merge, `null` removes a key, lists are replaced whole;
- `application/strategic-merge-patch+json`: applied as a merge-patch. Deviation: a real server merges some lists
  by key (containers by name, conditions by type, finalizers as a set...); here those lists are replaced whole;
- `application/json-patch+json` (RFC 6902) including `test` ops: a failing `test`, a missing path or a bad op
  answers 422 Unprocessable Entity, which kopf relies on for its optimistic finalizer patches;
- `application/apply-patch+yaml` (server-side apply) is not emulated: 415.
"""

from __future__ import annotations

from typing import Any

import jsonpatch
import jsonpointer

from tandem.manifest import merge_patched


class PatchError(ValueError):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


def json_patch(target: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    try:
        return jsonpatch.apply_patch(target, ops, in_place=False)
    except jsonpatch.JsonPatchTestFailed as error:
        raise PatchError(422, "Invalid", f"the server rejected our request due to an error in our request: "
                                         f"testing fails: {error}") from None
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException, KeyError, IndexError, TypeError) as error:
        raise PatchError(422, "Invalid", f"the server rejected our request due to an error in our request: "
                                         f"{error}") from None


def apply(current: dict[str, Any], body: Any, content_type: str | None) -> dict[str, Any]:
    """The object after the patch `body` of `content_type` (the Content-Type header, parameters ignored)."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media == JSON_PATCH:
        if not isinstance(body, list):
            raise PatchError(400, "BadRequest", "a JSON patch must be a list of operations")
        return json_patch(current, body)
    if media in (MERGE, STRATEGIC):
        if not isinstance(body, dict):
            raise PatchError(400, "BadRequest", "a merge patch must be a JSON object")
        return merge_patched(current, body)
    raise PatchError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - accepted media "
                                                  f"types include: {JSON_PATCH}, {MERGE}, {STRATEGIC} (not {media!r})")
