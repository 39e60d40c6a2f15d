"""Imports point one way: schemas <- producers/consumers <- envs/rollout/trainer <- ops.

A module may import its own layer or lower layers, never a higher one; ``schemas`` imports
nothing of ours. The check reads the source (import statements anywhere, including inside
functions), so a lazy upward import fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYER = {
    "schemas": 0,
    "producers": 1,
    "consumers": 1,
    "envs": 2,
    "rollout": 2,
    "trainer": 2,
    "ops": 3,
}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_imports_point_down_only() -> None:
    violations = []
    for package, level in LAYER.items():
        for path in (ROOT / package).rglob("*.py"):
            for name in _imports(path):
                parts = name.split(".")
                if parts[0] != "rlstream" or len(parts) < 2 or parts[1] not in LAYER:
                    continue
                if (package == "schemas" and parts[1] != "schemas") or LAYER[parts[1]] > level:
                    violations.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not violations, "upward imports:\n" + "\n".join(violations)


def test_every_layer_is_checked() -> None:
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert folders - {"tests"} <= set(LAYER), folders - set(LAYER)
