"""Docstrings stay short: what and why in a few lines, the rules a maintainer must keep, and a
pointer to the page under ``docs/`` that holds the derivations, measurements and history.

Every module, class and function docstring of the product code is at most ``MAX_LINES`` lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("consumers", "producers", "schemas", "trainer", "rollout", "envs", "ops")
TOP_LEVEL = ("__init__.py", "__main__.py")
MAX_LINES = 30
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def product_files() -> Iterator[Path]:
    yield from (ROOT / name for name in TOP_LEVEL if (ROOT / name).is_file())
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def long_docstrings(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, DOCUMENTED):
            continue
        doc = ast.get_docstring(node, clean=False)
        lines = doc.count("\n") + 1 if doc else 0
        if lines > MAX_LINES:
            name = getattr(node, "name", "<module>")
            yield f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)} {name}: {lines} lines"


def test_no_docstring_is_longer_than_the_limit() -> None:
    files = list(product_files())
    assert len(files) > 100  # the walk found the package
    too_long = [entry for path in files for entry in long_docstrings(path)]
    assert not too_long, (
        f"docstrings over {MAX_LINES} lines (keep the rules, move the rest to docs/):\n"
        + "\n".join(too_long)
    )
