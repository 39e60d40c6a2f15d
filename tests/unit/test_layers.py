"""Imports point one way: schemas <- producers <- consumers <- envs <- rollout <- trainer <- ops.

Each folder is its own layer. A module may import its own folder or a lower one, never a higher
one; ``schemas`` imports nothing of ours. So ``producers`` never reaches for a consumer, ``envs``
(task families, sandbox, judges) knows nothing of the policy, the policy model and the agent
harness live in ``rollout`` where generation happens, and ``trainer`` builds on all of them. The
check reads the source (import statements anywhere, including inside functions), so a lazy upward
import fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYER = {
    "schemas": 0,
    "producers": 1,
    "consumers": 2,
    "envs": 3,
    "rollout": 4,
    "trainer": 5,
    "ops": 6,
}


def _imports(path: Path) -> list[str]:
    """The modules ``path`` imports, as absolute names (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ["rlstream", *path.relative_to(ROOT).parent.parts]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.append(module)
            if module == "rlstream":  # ``from rlstream import trainer`` names the folder
                names += [f"rlstream.{a.name}" for a in node.names]
    return names


def test_imports_point_down_only() -> None:
    violations = []
    for package, level in LAYER.items():
        for path in (ROOT / package).rglob("*.py"):
            for name in _imports(path):
                parts = name.split(".")
                if parts[0] != "rlstream" or len(parts) < 2 or parts[1] not in LAYER:
                    continue
                if LAYER[parts[1]] > level:
                    violations.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not violations, "upward imports:\n" + "\n".join(violations)


def test_every_layer_is_checked() -> None:
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert folders - {"tests"} <= set(LAYER), folders - set(LAYER)


def test_reading_a_recipe_and_the_policy_free_roles_import_no_torch() -> None:
    """Entry points parse their config before importing heavy modules: the recipe and the roles
    that never run the policy (admission, judges, scheduler, feedback-rl) stay free of torch and
    transformers, so they start fast and stay small."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from rlstream.ops.config import load_run_config\n"
        "load_run_config(None, [])\n"
        "import rlstream.ops.roles, rlstream.consumers.admission, rlstream.envs.judges\n"
        "import rlstream.rollout.scheduler, rlstream.consumers.feedback_rl\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
