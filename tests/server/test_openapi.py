"""openapi.yaml (repo root) must describe the app as it is: same paths and methods, same wire
schemas. Regenerate after changing a route or schema:

    .venv/bin/python -m tests.server.test_openapi --write
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from server.app import create_app
from tests.server.conftest import make_test_settings

SPEC = Path(__file__).resolve().parents[2] / "openapi.yaml"
KEY_SCHEMAS = (
    "FileObject",
    "FileDeleted",
    "Batch",
    "BatchCreateRequest",
    "BatchRequestCounts",
    "BatchUsage",
    "BatchErrors",
    "BatchError",
    "ErrorEnvelope",
    "ErrorBody",
    "ModelList",
    "Model",
)


def app_spec() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        return create_app(make_test_settings(Path(tmp))).openapi()


def render(spec: dict[str, Any]) -> str:
    header = (
        "# Generated from the app by `python -m tests.server.test_openapi --write`;\n"
        "# tests/server/test_openapi.py fails when this file and the app disagree.\n"
    )
    return header + yaml.safe_dump(spec, sort_keys=False, allow_unicode=True, width=100)


def _operations(spec: dict[str, Any]) -> set[tuple[str, str]]:
    return {(path, method) for path, ops in spec["paths"].items() for method in ops}


def test_file_lists_the_same_paths_and_methods() -> None:
    assert _operations(yaml.safe_load(SPEC.read_text())) == _operations(app_spec())


def test_file_has_the_same_wire_schemas() -> None:
    file_schemas = yaml.safe_load(SPEC.read_text())["components"]["schemas"]
    app_schemas = app_spec()["components"]["schemas"]
    for name in KEY_SCHEMAS:
        assert file_schemas.get(name) == app_schemas[name], name


def test_file_is_exactly_what_the_app_generates() -> None:
    assert SPEC.read_text() == render(app_spec()), (
        "run: python -m tests.server.test_openapi --write"
    )


def test_spec_matches_the_sdk_field_names() -> None:
    """Every field the SDK's Batch and FileObject models declare is in our schemas."""
    from openai.types import Batch, FileObject

    schemas = app_spec()["components"]["schemas"]
    assert set(Batch.model_fields) <= set(schemas["Batch"]["properties"])
    assert set(FileObject.model_fields) <= set(schemas["FileObject"]["properties"])


def test_no_422_is_documented() -> None:
    spec = app_spec()
    for ops in spec["paths"].values():
        for op in ops.values():
            assert "422" not in op["responses"]


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        SPEC.write_text(render(app_spec()))
        print(f"wrote {SPEC}")
    else:
        sys.exit(
            f"usage: python -m {__spec__.name if __spec__ else 'tests.server.test_openapi'} --write"
        )
