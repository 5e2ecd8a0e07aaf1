"""docs/api.md is generated from the API models (tandem/api_reference.py): it fails here when they drift."""

from __future__ import annotations

from pathlib import Path

from tandem import api_reference
from tandem.crd import RESOURCES, structural_schema

ROOT = Path(__file__).resolve().parents[2]


def test_docs_api_md_is_what_the_models_say():
    assert (ROOT / "docs" / "api.md").read_text() == api_reference.render(), \
        "docs/api.md differs from the API models: run `make crds` (or python -m tandem.api_reference)"


def test_every_field_of_every_resource_is_in_the_reference():
    text = api_reference.render()
    for kind, info in RESOURCES.items():
        schema = structural_schema(info.model)
        assert f"## {kind}" in text
        for part in ("spec", "status"):
            for path, _, _ in api_reference._fields(schema["properties"][part]):
                assert f"| `{path}` |" in text, f"{kind} {part}.{path} is missing"


def test_check_mode_fails_on_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "api.md"
    stale.write_text("# API reference\n")
    assert api_reference.main(["--out", str(stale), "--check"]) == 1
    assert "run `make crds`" in capsys.readouterr().err
    assert api_reference.main(["--out", str(stale)]) == 0
    assert api_reference.main(["--out", str(stale), "--check"]) == 0
