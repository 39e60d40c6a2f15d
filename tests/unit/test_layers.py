"""Imports point one way: schemas <- producers <- consumers <- envs <- rollout <- trainer <- ops.

Each folder is its own layer. A module may import its own folder or a lower one, never a higher
one; ``schemas`` imports nothing of ours. So ``producers`` never reaches for a consumer, ``envs``
(task families, sandbox, judges) knows nothing of the policy, the policy model and the agent
harness live in ``rollout`` where generation happens, and ``trainer`` builds on all of them. The
check reads the source (import statements anywhere, including inside functions), so a lazy upward
import fails too.

Inside a layer, concepts live in rooms (subpackages: ``producers/weights``, ``ops/cli`` ...): a room
imports only the rooms of its layer that ``ROOMS`` lists (the command line is the top of ``ops``:
no other room imports it), every subpackage is a declared room, and the delta codec has no
import circle.
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


def _module_names() -> dict[str, Path]:
    """Every module of the package by its absolute name (a package by its ``__init__``)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] not in LAYER:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(["rlstream", *parts])] = path
    return out


def _import_graph(package: str) -> dict[str, set[str]]:
    """Which modules of ``package`` each module of it imports (``from . import x`` names the
    module x; a submodule's implicit import of its parent package is not an edge)."""
    modules = _module_names()
    inside = {m: p for m, p in modules.items() if m == package or m.startswith(package + ".")}
    graph: dict[str, set[str]] = {}
    for name, path in inside.items():
        here = ["rlstream", *path.relative_to(ROOT).parent.parts]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    edges.add(f"{module}.{a.name}" if f"{module}.{a.name}" in inside else module)
        graph[name] = (edges & inside.keys()) - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (empty when there is none)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_delta_codec_has_no_import_circle() -> None:
    """Inside the codec package imports form layers too (bits <- pieces <- coders <- exponent
    <- legacy <- encodings <- codec), lazy imports included: a circle would let a module see
    a half-initialised one, or hide which part depends on which."""
    graph = _import_graph("rlstream.schemas.deltacodec")
    assert len(graph) > 10, sorted(graph)
    assert not _cycle(graph), " -> ".join(_cycle(graph))


def test_the_circle_check_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert not _cycle({"a": {"b"}, "b": set()})


#: The rooms of a layer (its subpackages, one concept each) and the rooms of the same layer each
#: may import. A layer's modules outside any room (the roles, the consumer, the producer's
#: base) may use every room of their layer; a room never reaches into one not listed here.
ROOMS: dict[str, set[str]] = {
    "schemas.deltacodec": set(),
    "schemas.deltacodec.kernels": set(),
    "producers.client": set(),
    "producers.runtime": set(),
    "producers.weights": {"producers.client", "producers.runtime"},
    "producers.feedback": {"producers.client", "producers.runtime"},
    "consumers.weights": set(),
    "consumers.feedback": {"consumers.weights"},  # feedback-rl follows the policy version
    "envs.sandbox": set(),  # the boundary: imports no other room
    "rollout.vllm_server": set(),  # runs inside vLLM's own processes: imports nothing of ours
    "rollout.vllm_server.rlstream_vllm": set(),  # the weight-transfer backend, likewise
    "ops.observe": set(),
    "ops.run": {"ops.cluster", "ops.observe"},  # launching and supervising roles
    "ops.cluster": set(),
    "ops.forensics": {"ops.run"},  # replay, lineage, forget
    "ops.chaos": {"ops.run", "ops.cluster", "ops.observe"},  # faults, attacks, failover
    "ops.demo": {"ops.run", "ops.cluster", "ops.observe"},
    "ops.plan": set(),  # the sizing model: arithmetic only
    "ops.bench": {
        *("ops.run", "ops.observe", "ops.cluster", "ops.chaos", "ops.demo", "ops.plan"),
        "ops.forensics",  # bench chaos replays its run from the record
    },
    "ops.cli": {  # the top: none imports it
        *("ops.run", "ops.observe", "ops.cluster", "ops.bench", "ops.forensics", "ops.chaos"),
        *("ops.demo", "ops.plan"),
    },
}


def _room_of(module: str) -> str | None:
    """The declared room (the longest) a module of ours lies in, or None."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in ROOMS:
            return ".".join(parts[:n])
    return None


def _room_violations(imports: dict[str, list[str]]) -> list[str]:
    """``module -> what it imports`` checked against ``ROOMS``."""
    out = []
    for module, names in imports.items():
        here = _room_of(module)
        for name in names:
            there = _room_of(name) if name.startswith("rlstream.") else None
            if here is None or there is None or there == here:
                continue
            if there.split(".")[0] != here.split(".")[0]:
                continue  # another layer: the layering test's business
            if there.startswith(here + ".") or here.startswith(there + "."):
                continue  # a room and its own inner room
            if there not in ROOMS[here]:
                out.append(f"{module} ({here}) imports {name} ({there})")
    return out


def test_rooms_import_only_the_rooms_they_may() -> None:
    imports = {}
    for layer in LAYER:
        for path in (ROOT / layer).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            imports[".".join(["rlstream", *parts])] = _imports(path)
    violations = _room_violations(imports)
    assert not violations, "imports across rooms:\n" + "\n".join(violations)


def test_the_room_check_sees_a_reach_into_another_room() -> None:
    bad = {"rlstream.ops.demo.demo": ["rlstream.ops.cli.cmd_demo"]}
    assert _room_violations(bad) == [
        "rlstream.ops.demo.demo (ops.demo) imports rlstream.ops.cli.cmd_demo (ops.cli)"
    ]
    fine = {"rlstream.ops.cli.cmd_demo": ["rlstream.ops.demo.demo", "rlstream.schemas.topics"]}
    assert _room_violations(fine) == []


def test_every_room_is_declared() -> None:
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for layer in LAYER
        for p in (ROOT / layer).rglob("__init__.py")
        if p.parent != ROOT / layer
    }
    assert found == set(ROOMS), (found - set(ROOMS), set(ROOMS) - found)


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
        "from rlstream.ops.run.config import load_run_config\n"
        "load_run_config(None, [])\n"
        "import rlstream.ops.run.roles, rlstream.consumers.admission, rlstream.envs.judges\n"
        "import rlstream.rollout.scheduler, rlstream.consumers.feedback.rl\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
