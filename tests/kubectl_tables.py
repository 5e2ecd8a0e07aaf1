"""`kubectl get`'s output by column, for the tests that run the real kubectl (integration/test_kubectl.py on the
emulated cluster, e2e/test_kind.py on kind)."""

from __future__ import annotations

import re


def table(text: str) -> list[dict[str, str]]:
    """kubectl's rows by column, each cut where its header's name starts: a cell may be empty (kubectl prints a
    null cell of a custom column as nothing) and a name may hold single spaces (`NOMINATED NODE`)."""
    header, *lines = [line for line in text.splitlines() if line.strip()]
    starts = [match.start() for match in re.finditer(r"\S+(?: \S+)*", header)]
    ends = [*starts[1:], None]
    names = [header[start:end].strip() for start, end in zip(starts, ends, strict=True)]
    return [{name: line[start:end].strip() for name, start, end in zip(names, starts, ends, strict=True)}
            for line in lines]
