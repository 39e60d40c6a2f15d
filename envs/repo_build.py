"""Building ``repo`` tasks from real packages (``rlstream env build-repo-tasks``).

For each package: its sdist is downloaded from the package index with ``pip download`` (at build
time only; nothing is fetched when tasks are used), unpacked, and trimmed (``trim``) to what its
tests need: that is the package's *tree*. Its test suite is run in the sandbox
(``repo_driver``'s ``list`` role) ``STABLE_RUNS`` times, each from a fresh interpreter (so with
its own hash seed); the tests that pass in every run are the candidates, less every test file
whose passing ids differ between runs (``stable``: a parametrized id built from set or dict
order names a different test in another process), less every test that does not pass in a
judged run (``repo.judged_outcomes``: the tests run apart from the package, so a test that
patches the standard library the package uses cannot judge it). A package that yields no
candidate is left out with the reason (``diagnose``), and the others go on.

Bugs are injected by mutating one operator or constant in a function of the package (not its
tests), at sites drawn with ``random.Random(seed)``: a comparison (``<`` and ``<=``, ``>`` and
``>=``, ``==`` and ``!=``, ``is`` and ``is not``, ``in`` and ``not in``), an arithmetic ``+`` and
``-``, ``and`` and ``or``, ``True`` and ``False``, a small integer ``n`` to ``n + 1``. The mutated
suite runs in the sandbox; a mutation is kept as a task only if some tests that passed now fail (at most
``MAX_FAIL_TO_PASS``: more means the package breaks as a whole, not one function), in a judged
run too: those are FAIL_TO_PASS, and PASS_TO_PASS are the tests of the same files that pass both ways (at
most ``MAX_PASS_TO_PASS``). The task's ``base_patch`` injects the bug, its ``patch`` (the
reference) undoes it, ``test_patch`` is empty (the tests are the package's own); the seed, the
package, its version and the sdist's sha256 are recorded. The next site tried is of the package
with the fewest tasks so far (``next_package``), so the tasks spread evenly over the packages.
Pure functions: ``sites``, ``mutate``, ``trim``'s rules (``needs``, ``select``), ``stable``,
``diagnose``, ``next_package``; the rest runs pip and pytest.
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
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlstream.envs import patches, repo, repo_tools, sandbox
from rlstream.schemas.errors import SetupError

# A tree must fit the policy's workspace (``repo_tools.MAX_FILES`` files, ``MAX_BYTES`` bytes:
# an edit past either is refused), with room left for an answer's new files and longer lines.
MAX_FILES = repo_tools.MAX_FILES - 4
MAX_BYTES = repo_tools.MAX_BYTES * 3 // 4
MAX_PASS_TO_PASS = 40
MAX_FAIL_TO_PASS = 30
STABLE_RUNS = 3
_SKIP_TOPS = ("docs", "doc", "documentation", "examples", "build", "benchmarks", "benchmark")
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


def is_test_module(path: str) -> bool:
    """A module pytest collects by its name (``test_*.py``, ``*_test.py``)."""
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def candidates(root: Path) -> dict[str, str]:
    """The ``.py`` files of an unpacked sdist, less ``setup.py``, ``conf.py``, egg-info, and
    names a workspace cannot hold."""
    keep: dict[str, str] = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel in ("setup.py", "conf.py"):
            continue
        if ".egg-info" in rel or "__pycache__" in rel:
            continue
        try:
            sandbox.check_name(rel)
        except ValueError:
            continue
        keep[rel] = p.read_text(encoding="utf-8", errors="replace")
    return keep


def source_paths(files: Iterable[str]) -> list[str]:
    """The tree's folder for ``sys.path``: ``src`` (a src layout) or ``.``. Never a test folder:
    its helpers stay the tests' own, imported on the verdict side (``repo.verdict_side``; pytest
    puts a test's folder on ``sys.path`` itself), never served by the answer's process, where
    the package could replace their asserts."""
    return ["src" if any(f.startswith("src/") for f in files) else "."]


def _named(path: str, source: str) -> set[str]:
    """What ``path``'s imports may name: ``mod:a/b`` for ``a.b`` and each of its parents
    (absolute: resolved against a root later), ``rel:x/y`` for a relative import (a path)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    here = path.split("/")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level - 1 > len(here):
                continue
            base = here[: len(here) - node.level + 1] + (node.module or "").split(".")
            base = [b for b in base if b]
            out.add("rel:" + "/".join(base))
            out.update("rel:" + "/".join([*base, a.name]) for a in node.names)
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            out.update("mod:" + "/".join(parts[: i + 1]) for i in range(len(parts)))
    return out


def needs(files: dict[str, str], start: Iterable[str], roots: list[str]) -> set[str]:
    """``start`` and every file of ``files`` they need, transitively: what they import
    (resolved against ``roots`` and the importer's own folder), and the ``__init__.py`` and
    ``conftest.py`` of every folder above (the root's included)."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        path = todo.pop()
        if path in seen or path not in files:
            continue
        seen.add(path)
        folders = path.split("/")[:-1]
        above = ["/".join(folders[: i + 1]) + "/" for i in range(len(folders))]
        todo += [f"{d}{n}" for d in ["", *above] for n in ("__init__.py", "conftest.py")]
        prefixes = {"", *("" if r in ("", ".") else r.rstrip("/") + "/" for r in roots)}
        prefixes.add(above[-1] if above else "")
        for named in _named(path, files[path]):
            kind, stem = named.split(":", 1)
            for prefix in prefixes if kind == "mod" else {""}:
                todo += [f"{prefix}{stem}.py", f"{prefix}{stem}/__init__.py"]
    return seen


def _size(files: dict[str, str], keep: Iterable[str]) -> tuple[int, int]:
    names = list(keep)
    return len(names), sum(len(files[n].encode()) for n in names)


def select(files: dict[str, str], roots: list[str]) -> set[str]:
    """The files a tree keeps (``trim``'s rule): the whole, when it fits ``MAX_FILES`` and
    ``MAX_BYTES`` (every file but docs, examples, benchmarks and build output, and the files of
    those the tests import); else the ``needs`` of as many test modules as fit, smallest first
    (a mutation is only caught in what the kept tests import). ValueError when none fits."""
    tests = sorted(p for p in files if is_test_module(p) and p.split("/")[0] not in _SKIP_TOPS)
    if not tests:
        raise ValueError("no tests found (no test_*.py or *_test.py in the sdist)")
    whole = {p for p in files if p.split("/")[0] not in _SKIP_TOPS} | needs(files, tests, roots)
    n, size = _size(files, whole)
    if n <= MAX_FILES and size <= MAX_BYTES:
        return whole
    cost = {t: needs(files, [t], roots) for t in tests}
    keep: set[str] = set()
    for t in sorted(tests, key=lambda t: (*_size(files, cost[t]), t)):
        n_new, size_new = _size(files, keep | cost[t])
        if n_new <= MAX_FILES and size_new <= MAX_BYTES:
            keep |= cost[t]
    if not keep:
        least = min(_size(files, c) for c in cost.values())
        raise ValueError(
            f"{n} files ({size} bytes) after trimming, and the smallest test module needs "
            f"{least[0]} files ({least[1]} bytes): at most {MAX_FILES} files, {MAX_BYTES} bytes"
        )
    return keep


def trim(root: Path) -> tuple[dict[str, str], list[str]]:
    """The files of an unpacked sdist its tests need (``candidates``, then ``select``), and the
    source folders for ``sys.path``; ValueError saying why when none will do."""
    found = candidates(root)
    keep = select(found, source_paths(found))
    files = {p: found[p] for p in sorted(keep)}
    return files, source_paths(files)


def download(package: str, into: Path) -> tuple[Path, str, str]:
    """(sdist, version, sha256) of ``package`` (``NAME`` or ``NAME==VERSION``), via pip: the
    package itself from its sdist, what builds its metadata as wheels (quick)."""
    name = re.split(r"[=<>!~ \[;]", package, maxsplit=1)[0].strip()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name]
    cmd += ["-q", "--disable-pip-version-check", "-d", str(into), package]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise SetupError("pip download took over 300 s") from None
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        if any("No matching distribution" in ln for ln in said):
            raise SetupError(f"no sdist on the package index ({said[-1][:300]})")
        raise SetupError(f"pip download failed: {(said or ['?'])[-1][:300]}")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = [p for p in into.iterdir() if re.sub(r"[-_.]+", "_", p.name).lower().startswith(stem)]
    if not found or not found[0].name.endswith((".tar.gz", ".zip")):
        raise SetupError(f"no sdist: pip download left {[p.name for p in found]}")
    sdist = found[0]
    version = sdist.name[len(stem) + 1 :].removesuffix(".tar.gz").removesuffix(".zip")
    return sdist, version, hashlib.sha256(sdist.read_bytes()).hexdigest()


def unpack(sdist: Path, into: Path) -> Path:
    """The folder ``sdist`` unpacks to (its single top folder, as sdists have)."""
    if sdist.name.endswith(".zip"):
        with zipfile.ZipFile(sdist) as z:  # extract() drops absolute and ``..`` parts
            for member in z.namelist():
                z.extract(member, into)
    else:
        with tarfile.open(sdist) as tar:
            tar.extractall(into, filter="data")
    tops = [p for p in into.iterdir() if p.is_dir()]
    return tops[0] if len(tops) == 1 else into


_MISSING = re.compile(r"No module named '([\w.]+)'")


def _first(messages: dict[str, Any], test: str) -> str:
    return (messages.get(test) or ["(no message)"])[0].removeprefix("E").strip()


def diagnose(outcomes: dict[str, str], messages: dict[str, Any], files: Iterable[str]) -> str:
    """Why a suite run's ``outcomes`` hold no passing test, in a line: the run's own error, or
    nothing collected; else the first failure of the tests that ran, and the modules the test
    files import that neither the tree nor the sandbox has (``tests need packages ...``) or else
    the first collection error, the tests that ran first when some did."""
    if not outcomes:
        error = messages.get("error")
        return f"the test run failed: {error}" if error else "pytest collected no tests"
    ours = {part.removesuffix(".py") for f in files for part in f.split("/")}
    said = [ln for lines in messages.values() if isinstance(lines, list) for ln in lines]
    missing = {m.split(".")[0] for ln in said for m in _MISSING.findall(ln)} - ours
    broken = sorted(t for t, o in outcomes.items() if o == "error" and "::" not in t)
    clauses = []
    if missing:
        clauses.append(
            f"tests need packages {', '.join(sorted(missing))} not installed in the sandbox"
        )
    elif broken:
        clauses.append(f"test collection failed: {broken[0]}: {_first(messages, broken[0])}")
    ran = sorted(t for t in outcomes if "::" in t)
    bad = [t for t in ran if outcomes[t] in ("failed", "error")]
    if bad:
        clauses.insert(
            0, f"no test passes: {bad[0]} {outcomes[bad[0]]}: {_first(messages, bad[0])}"
        )
    elif ran:
        clauses.insert(0, f"no test passes: {len(ran)} collected, all skipped")
    return "; ".join(clauses)


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
    """One package's tree, the tests that pass on it, and what its suite left out (a line)."""

    name: str
    version: str
    sha256: str
    tree_id: str
    files: dict[str, str]
    paths: list[str]
    passing: set[str]
    left_out: str = ""

    def tree_row(self) -> dict[str, Any]:
        return {"tree": self.tree_id, "repo": f"{self.name}=={self.version}", "paths": self.paths,
                "files": self.files}  # fmt: skip


def _passing(files: dict[str, str], paths: list[str]) -> tuple[set[str], str]:
    """The tests that pass steadily and judged (module rules), and a line saying what was left
    out: the whole reason (``diagnose``) when nothing passes, else the collection errors."""
    runs: list[set[str]] = []
    outcomes: dict[str, str] = {}
    messages: dict[str, Any] = {}
    for _ in range(STABLE_RUNS):  # each run has its own hash seed
        outcomes, messages = run_suite_fresh(files, paths)
        runs.append({t for t, o in outcomes.items() if o == "passed"})
    if not set().union(*runs):
        return set(), diagnose(outcomes, messages, files)
    passing = stable(runs)
    if not passing:
        return set(), "no test passes in every run with the same ids (ids from set order)"
    judged, said = repo.judged_outcomes(files, paths, sorted(passing), _suite_box())
    passing = {t for t in passing if judged.get(t) == "passed"}
    if not passing:
        return set(), f"no test passes in a judged run (apart from the package): {said[:300]}"
    uncollected = {t: o for t, o in outcomes.items() if o == "error" and "::" not in t}
    if not uncollected:
        return passing, ""
    return (
        passing,
        f"{len(uncollected)} test files left out: {diagnose(uncollected, messages, files)}",
    )


def prepare(package: str, work: Path) -> Package:
    """Download, unpack, trim and run the suite of ``package``; SetupError saying why when it
    yields no test that can judge a task."""
    sdist, version, sha = download(package, work)
    root = unpack(sdist, work / "src")
    try:
        files, paths = trim(root)
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    passing, left_out = _passing(files, paths)
    if not passing:
        raise SetupError(left_out)
    name = root.name[: -len(version) - 1] if root.name.endswith(version) else root.name
    tree_id = f"{name}-{version}-{sha[:12]}"
    return Package(name, version, sha, tree_id, files, paths, passing, left_out)


def _statement(site: Site, failing: list[str], messages: dict[str, Any]) -> str:
    test = failing[0]
    said = "\n".join(f"    {ln}" for ln in messages.get(test, [])) or "    (no message)"
    return (
        f"A bug in `{site.func}` ({site.path}) breaks the package's tests: `{test}` fails "
        f"({len(failing)} failing in all):\n\n{said}\n\nFind the bug and fix it."
    )


def try_site(pkg: Package, site: Site, seed: int) -> dict[str, Any] | None:
    """The task of one mutation, or None when no passing test fails with it, in a plain run
    and then in a judged one (a test that reaches the bug only in the package's own process,
    e.g. a descriptor of the package on a class of the tests, cannot judge it)."""
    buggy = dict(pkg.files)
    buggy[site.path] = mutate(pkg.files[site.path], site)
    outcomes, messages = run_suite(buggy, pkg.paths)
    broke = sorted(t for t in pkg.passing if outcomes.get(t) != "passed")
    if not outcomes or not 1 <= len(broke) <= MAX_FAIL_TO_PASS:
        return None  # no test notices it, or the package breaks as a whole (not one bug)
    judged, _ = repo.judged_outcomes(buggy, pkg.paths, broke, _suite_box())
    failing = [t for t in broke if judged and judged.get(t) != "passed"]
    if not failing:
        return None
    files_of = {t.split("::", 1)[0] for t in failing}
    still = sorted(t for t in pkg.passing - set(broke) if t.split("::", 1)[0] in files_of)
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


def next_package(kept: list[int], left: list[int]) -> int:
    """The package whose site is tried next: of those with sites ``left``, the one with the
    fewest tasks ``kept`` so far, the first given on a tie (so tasks spread evenly over the
    packages, however often each one's mutations are kept)."""
    return min((k, i) for i, k in enumerate(kept) if left[i])[1]


def _prepared(packages: list[str], log: Any) -> tuple[list[Package], dict[str, str]]:
    """The packages that yield a tree, and why each other one does not (``{spec: reason}``);
    SetupError naming every reason when none does."""
    pkgs, failed = [], {}
    with tempfile.TemporaryDirectory(prefix="rlstream-repo-build-") as tmp:
        for i, spec in enumerate(packages):
            try:
                pkg = prepare(spec, Path(tmp, str(i)))
            except SetupError as exc:
                failed[spec] = str(exc)
                log(f"{spec}: left out: {exc}")
                continue
            pkgs.append(pkg)
            note = f" ({pkg.left_out})" if pkg.left_out else ""
            log(f"{pkg.name} {pkg.version}: {len(pkg.files)} files, "
                f"{len(pkg.passing)} passing tests{note}")  # fmt: skip
    if not pkgs:
        raise SetupError(
            "no package yields tasks: " + "; ".join(f"{k}: {v}" for k, v in failed.items())
        )
    return pkgs, failed


def build(packages: list[str], count: int, seed: int, log: Any = print) -> dict[str, Any]:
    """Tree rows then task rows, and the summary (``tasks``, ``packages``, ``by_package``,
    ``failed``: why each package left out was, ``kept``, ``dropped``) (module rules)."""
    rng = random.Random(seed)
    pkgs, failed = _prepared(packages, log)
    queues = []
    for pkg in pkgs:
        found = [
            s
            for path in sorted(pkg.files)
            if not repo.is_test_file(path)
            for s in sites(path, pkg.files[path])
        ]  # fmt: skip  (tests are never mutated)
        rng.shuffle(found)
        queues.append(found)
    tasks: list[dict[str, Any]] = []
    dropped = 0
    kept = [0] * len(pkgs)
    while len(tasks) < count and any(queues):
        i = next_package(kept, [len(q) for q in queues])
        task = try_site(pkgs[i], queues[i].pop(), seed)
        dropped += task is None
        if task is not None:
            tasks.append(task)
            kept[i] += 1
            log(f"kept {task['instance_id']} ({len(task['FAIL_TO_PASS'])} fail to pass)")
    by_package = {p.name: n for p, n in zip(pkgs, kept, strict=True)}
    summary = {
        "tasks": len(tasks),
        "packages": {p.name: p.version for p in pkgs},
        "by_package": by_package,
        "failed": failed,
        "kept": len(tasks),
        "dropped": dropped,
    }
    return {"rows": [p.tree_row() for p in pkgs] + tasks, "summary": summary}


if __name__ == "__main__":  # run_suite_fresh's child: {"files", "paths"} in, outcomes out
    given = json.loads(sys.stdin.read())
    print(json.dumps(run_suite(given["files"], given["paths"])))
