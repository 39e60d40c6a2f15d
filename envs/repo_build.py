"""Building ``repo`` tasks from real packages (``rlstream env build-repo-tasks``).

For each package: its sdist is downloaded from the package index with ``pip download`` (at build
time only; nothing is fetched when tasks are used), unpacked, and trimmed to what its tests need
(the package's ``.py`` files and its test files; ``src/`` and ``tests/`` kept as folders, at most
``MAX_FILES`` files): that is the package's *tree*. Its test suite is run once in the sandbox
(``repo_driver``'s ``list`` role) ``STABLE_RUNS`` times, each from a fresh interpreter (so with
its own hash seed); the tests that pass in every run are the candidates, less every test file
whose passing ids differ between runs (``stable``: a parametrized id built from set or dict
order names a different test in another process), less every test that does not pass in a
judged run (``repo.judged_outcomes``: the tests run apart from the package, so a test that
patches the standard library the package uses cannot judge it).

Bugs are injected by mutating one operator or constant in a function of the package (not its
tests), at sites drawn with ``random.Random(seed)``: a comparison (``<`` and ``<=``, ``>`` and
``>=``, ``==`` and ``!=``, ``is`` and ``is not``, ``in`` and ``not in``), an arithmetic ``+`` and
``-``, ``and`` and ``or``, ``True`` and ``False``, a small integer ``n`` to ``n + 1``. The mutated
suite runs in the sandbox; a mutation is kept as a task only if some tests that passed now fail (at most
``MAX_FAIL_TO_PASS``: more means the package breaks as a whole, not one function):
those are FAIL_TO_PASS, and PASS_TO_PASS are the tests of the same files that pass both ways (at
most ``MAX_PASS_TO_PASS``). The task's ``base_patch`` injects the bug, its ``patch`` (the
reference) undoes it, ``test_patch`` is empty (the tests are the package's own); the seed, the
package, its version and the sdist's sha256 are recorded. Packages are taken in turn, so the
tasks spread over them. Pure functions: ``sites``, ``mutate``, ``trim``; the rest runs pytest.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlstream.envs import patches, repo_tools, sandbox
from rlstream.schemas.errors import SetupError

MAX_FILES = 60
MAX_PASS_TO_PASS = 40
MAX_FAIL_TO_PASS = 30
STABLE_RUNS = 3
_SWAP = {
    ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Is: ("is not", "is"),
    ast.IsNot: ("is not", "is"), ast.In: ("not in", "in"), ast.NotIn: ("not in", "in"),
    ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.And: ("and", "or"), ast.Or: ("or", "and"),
}  # fmt: skip


@dataclass(frozen=True)
class Site:
    """One mutation: in ``path``, line ``line`` (1-based), ``old`` at column ``col`` -> ``new``;
    ``func`` is the enclosing function."""

    path: str
    line: int
    col: int
    old: str
    new: str
    func: str


def _between(lines: list[str], a: ast.AST, b: ast.AST, text: str) -> int:
    """The column of ``text`` between nodes ``a`` and ``b`` on one line, else -1."""
    if a.end_lineno != b.lineno:  # type: ignore[attr-defined]
        return -1
    row = lines[b.lineno - 1]  # type: ignore[attr-defined]
    seg = row[a.end_col_offset : b.col_offset]  # type: ignore[attr-defined]
    m = re.search(rf"(?<![\w=<>!]){re.escape(text)}(?![\w=<>])", seg)
    return a.end_col_offset + m.start() if m else -1  # type: ignore[attr-defined]


def _node_sites(path: str, lines: list[str], node: ast.AST, func: str) -> list[Site]:
    pairs: list[tuple[ast.AST, ast.AST, type[ast.AST]]] = []
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        pairs.append((node.left, node.comparators[0], type(node.ops[0])))
    elif isinstance(node, ast.BinOp) and type(node.op) in _SWAP:
        pairs.append((node.left, node.right, type(node.op)))
    elif isinstance(node, ast.BoolOp):
        pairs.append((node.values[0], node.values[1], type(node.op)))
    out = []
    for a, b, op in pairs:
        old, new = _SWAP[op] if op not in (ast.Is, ast.In) else _SWAP[op][::-1]
        col = _between(lines, a, b, old)
        if col >= 0:
            out.append(Site(path, b.lineno, col, old, new, func))  # type: ignore[attr-defined]
    if isinstance(node, ast.Constant) and node.lineno == node.end_lineno:
        text = lines[node.lineno - 1][node.col_offset : node.end_col_offset]
        if node.value is True or node.value is False:
            out.append(Site(path, node.lineno, node.col_offset, text, str(not node.value), func))
        elif type(node.value) is int and text.isdigit() and 0 <= node.value < 10:
            out.append(Site(path, node.lineno, node.col_offset, text, str(node.value + 1), func))
    return out


def sites(path: str, source: str) -> list[Site]:
    """Every mutation site in the functions of one module, in source order."""
    lines = source.splitlines()
    found: list[Site] = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for stmt in fn.body:
                for node in ast.walk(stmt):
                    found += _node_sites(path, lines, node, fn.name)
    unique = {(s.line, s.col, s.old): s for s in found}
    return sorted(unique.values(), key=lambda s: (s.line, s.col))


def mutate(source: str, site: Site) -> str:
    """``source`` with ``site`` applied (it must be there)."""
    lines = source.splitlines(keepends=True)
    row = lines[site.line - 1]
    if row[site.col : site.col + len(site.old)] != site.old:
        raise ValueError(f"{site} is not in the source")
    lines[site.line - 1] = row[: site.col] + site.new + row[site.col + len(site.old) :]
    return "".join(lines)


def trim(root: Path) -> tuple[dict[str, str], list[str]]:
    """The files of an unpacked sdist the tests need, and the source folders for ``sys.path``."""
    keep: dict[str, str] = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        top = rel.split("/", 1)[0]
        if top in ("docs", "doc", "documentation", "examples", "build", "benchmarks"):
            continue
        if rel in ("setup.py", "conf.py") or ".egg-info" in rel or "__pycache__" in rel:
            continue
        try:
            sandbox.check_name(rel)
        except ValueError:
            continue
        keep[rel] = p.read_text(encoding="utf-8", errors="replace")
    paths = ["src" if (root / "src").is_dir() else "."]
    if (root / "tests").is_dir():
        paths.append("tests")
    if len(keep) > MAX_FILES:
        raise ValueError(f"{root.name}: {len(keep)} files after trimming (at most {MAX_FILES})")
    return keep, paths


def download(package: str, into: Path) -> tuple[Path, str, str]:
    """(sdist, version, sha256) of ``package`` (``NAME`` or ``NAME==VERSION``), via pip."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    cmd += ["-q", "-d", str(into), package]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SetupError(f"pip download {package} failed: {done.stderr.strip()[-500:]}")
    name = re.split(r"[=<>!~ ]", package, maxsplit=1)[0].lower().replace("-", "_")
    found = [p for p in into.iterdir() if p.name.lower().replace("-", "_").startswith(name)]
    if not found:
        raise SetupError(f"pip download {package}: no sdist in {into}")
    sdist = found[0]
    version = sdist.name[len(name) + 1 :].removesuffix(".tar.gz").removesuffix(".zip")
    return sdist, version, hashlib.sha256(sdist.read_bytes()).hexdigest()


def _suite_box() -> sandbox.SandboxConfig:
    return sandbox.SandboxConfig(
        wall_timeout_s=120, cpu_limit_s=120, memory_bytes=2**30, max_processes=32,
        disk_bytes=64 * 2**20, max_file_bytes=8 * 2**20, max_output_bytes=2**22,
        library=(repo_tools.test_library(),),
    )  # fmt: skip


def run_suite(files: dict[str, str], paths: list[str]) -> tuple[dict[str, str], dict[str, Any]]:
    """Every test's outcome and failure lines for ``files``, run in the sandbox."""
    result = sandbox.run(repo_tools.driver("list", paths, []), _suite_box(), files=files)
    last = (result.stdout.strip().splitlines() or [""])[-1]
    try:
        outcomes, messages = json.loads(last)
    except (json.JSONDecodeError, ValueError):
        return {}, {"error": f"{result.status}: {result.reason or result.stderr[-300:]}"}
    return outcomes, messages


def stable(runs: list[set[str]]) -> set[str]:
    """The tests that passed in every run, less every test file whose passing ids differ
    between runs (its ids hang on set or dict order: one of them may name another test next
    time even where it matched by chance)."""

    def by_file(ids: set[str]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for t in ids:
            out.setdefault(t.split("::", 1)[0], set()).add(t)
        return out

    files = [by_file(r) for r in runs]
    names = set().union(*files)
    steady = {f for f in names if all(fs.get(f) == files[0].get(f) for fs in files)}
    return {t for t in set.intersection(*runs) if t.split("::", 1)[0] in steady}


def run_suite_fresh(
    files: dict[str, str], paths: list[str]
) -> tuple[dict[str, str], dict[str, Any]]:
    """``run_suite`` from a fresh interpreter: its sandboxes fork from a helper with a hash seed
    of its own (every sandbox of one process shares its helper's), so test ids built from set
    or dict order show whether they move."""
    done = subprocess.run(
        [sys.executable, "-m", "rlstream.envs.repo_build"],
        input=json.dumps({"files": files, "paths": paths}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        return {}, {"error": done.stderr.strip()[-300:]}
    outcomes, messages = json.loads(done.stdout)
    return outcomes, messages


@dataclass
class Package:
    """One package's tree and the tests that pass on it."""

    name: str
    version: str
    sha256: str
    tree_id: str
    files: dict[str, str]
    paths: list[str]
    passing: set[str]

    def tree_row(self) -> dict[str, Any]:
        return {"tree": self.tree_id, "repo": f"{self.name}=={self.version}", "paths": self.paths,
                "files": self.files}  # fmt: skip


def prepare(package: str, work: Path) -> Package:
    """Download, unpack, trim and run the suite of ``package``."""
    sdist, version, sha = download(package, work)
    with tarfile.open(sdist) as tar:
        tar.extractall(work / "src", filter="data")
    (root,) = [p for p in (work / "src").iterdir() if p.is_dir()]
    files, paths = trim(root)
    runs = []
    info: dict[str, Any] = {}
    for _ in range(STABLE_RUNS):  # each run has its own hash seed
        outcomes, info = run_suite_fresh(files, paths)
        runs.append({t for t, o in outcomes.items() if o == "passed"})
    passing = stable(runs)
    if passing:
        from rlstream.envs.repo import judged_outcomes

        judged = judged_outcomes(files, paths, sorted(passing), _suite_box())
        passing = {t for t in passing if judged.get(t) == "passed"}
    if not passing:
        raise SetupError(f"{package}: no test passes in the sandbox ({info.get('error', '')})")
    name = root.name[: -len(version) - 1] if root.name.endswith(version) else root.name
    tree_id = f"{name}-{version}-{sha[:12]}"
    return Package(name, version, sha, tree_id, files, paths, passing)


def _statement(site: Site, failing: list[str], messages: dict[str, Any]) -> str:
    test = failing[0]
    said = "\n".join(f"    {ln}" for ln in messages.get(test, [])) or "    (no message)"
    return (
        f"A bug in `{site.func}` ({site.path}) breaks the package's tests: `{test}` fails "
        f"({len(failing)} failing in all):\n\n{said}\n\nFind the bug and fix it."
    )


def try_site(pkg: Package, site: Site, seed: int) -> dict[str, Any] | None:
    """The task of one mutation, or None when no passing test fails with it."""
    buggy = dict(pkg.files)
    buggy[site.path] = mutate(pkg.files[site.path], site)
    outcomes, messages = run_suite(buggy, pkg.paths)
    failing = sorted(t for t in pkg.passing if outcomes.get(t) != "passed")
    if not outcomes or not 1 <= len(failing) <= MAX_FAIL_TO_PASS:
        return None  # no test notices it, or the package breaks as a whole (not one bug)
    files_of = {t.split("::", 1)[0] for t in failing}
    still = sorted(t for t in pkg.passing - set(failing) if t.split("::", 1)[0] in files_of)
    return {
        "instance_id": f"{pkg.name}-{pkg.version}__{site.path.replace('/', '.')}-L{site.line}c{site.col}",
        "repo": f"{pkg.name}=={pkg.version}",
        "base": pkg.tree_id,
        "base_patch": patches.diff(pkg.files, buggy),
        "problem_statement": _statement(site, failing, messages),
        "FAIL_TO_PASS": failing,
        "PASS_TO_PASS": still[:MAX_PASS_TO_PASS],
        "patch": patches.diff(buggy, pkg.files),
        "test_patch": "",
        "seed": seed,
        "source": {"package": pkg.name, "version": pkg.version, "sha256": pkg.sha256,
                   "mutation": {"path": site.path, "line": site.line, "old": site.old,
                                "new": site.new}},
    }  # fmt: skip


def build(packages: list[str], count: int, seed: int, log: Any = print) -> dict[str, Any]:
    """Tree rows then task rows, and the summary (``tasks``, ``packages``, ``kept``,
    ``dropped``) (module rules)."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="rlstream-repo-build-") as tmp:
        pkgs = []
        for i, p in enumerate(packages):
            pkgs.append(prepare(p, Path(tmp, str(i))))
            log(f"{pkgs[-1].name} {pkgs[-1].version}: {len(pkgs[-1].files)} files, "
                f"{len(pkgs[-1].passing)} passing tests")  # fmt: skip
    from rlstream.envs.repo import is_test_file  # tests are never mutated

    queues = []
    for pkg in pkgs:
        found = [s for path in sorted(pkg.files) if not is_test_file(path)
                 for s in sites(path, pkg.files[path])]  # fmt: skip
        rng.shuffle(found)
        queues.append(found)
    tasks: list[dict[str, Any]] = []
    dropped = 0
    while len(tasks) < count and any(queues):
        for pkg, queue in zip(pkgs, queues, strict=True):
            if len(tasks) >= count or not queue:
                continue
            task = try_site(pkg, queue.pop(), seed)
            dropped += task is None
            if task is not None:
                tasks.append(task)
                log(f"kept {task['instance_id']} ({len(task['FAIL_TO_PASS'])} fail to pass)")
    summary = {
        "tasks": len(tasks),
        "packages": {p.name: p.version for p in pkgs},
        "kept": len(tasks),
        "dropped": dropped,
    }
    return {"rows": [p.tree_row() for p in pkgs] + tasks, "summary": summary}


if __name__ == "__main__":  # run_suite_fresh's child: {"files", "paths"} in, outcomes out
    given = json.loads(sys.stdin.read())
    print(json.dumps(run_suite(given["files"], given["paths"])))
