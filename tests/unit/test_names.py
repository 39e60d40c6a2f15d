"""One name, one thing: a class name is defined once in the package, so a name in a log line, a
traceback or a grep leads to one place."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("schemas", "producers", "consumers", "envs", "rollout", "trainer", "ops")


def test_every_class_name_is_defined_once() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"class names defined more than once: {twice}"
