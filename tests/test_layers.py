"""Imports point one way: server → runtime → scheduler (STYLE.md rule 1)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "scheduler": {"torch", "fastapi", "sqlalchemy", "server", "runtime", "starlette", "alembic"},
    "runtime": {"server", "fastapi", "sqlalchemy", "starlette", "alembic"},
}


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_never_imports_upwards(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imported_roots(path) & FORBIDDEN[package])
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}
