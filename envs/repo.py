"""The ``repo`` task family: fix a real repository so that its own tests pass (SWE-bench shape).

A task file is JSONL of *tree* rows (a repository snapshot, held once) and *task* rows in
SWE-bench's shape; ``path = "builtin:NAME"`` reads ``envs/data/NAME`` (``repo/tasks.jsonl``, built
by ``rlstream env build-repo-tasks``). The answer is the workspace's diff against the base.

Rules a maintainer must keep:
- a broken row is reported as ``FILE:LINE: what is wrong``; the others still load;
- the held-out split is a stable hash of the instance id, with an evaluation seed;
- scoring applies the patch in a fresh judged sandbox run and lays the test files again from the
  base (an answer cannot change its tests); FAIL_TO_PASS and PASS_TO_PASS must all pass;
- the tests, pytest and the outcomes live in the verdict side, which never executes a line of
  the patch: the patched package is used through the bridge (``envs.repo_bridge``), and
  ``envs.patch_policy`` refuses trees that plant test machinery or start-up hooks.

Details: docs/environments.md (The repo family in full).
"""

from __future__ import annotations

import functools
import json
import logging
import random
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlstream.envs import patch_policy, patches, repo_tools, sandbox
from rlstream.envs.dataset import DATA, hashed_split, resolve, seed_split, verdict_of
from rlstream.envs.family import EVAL_SEED_BASE, FamilyTask, Split, TaskFamily, Verdict
from rlstream.envs.tools import Environment

log = logging.getLogger(__name__)


class RepoConfig(BaseModel):
    """Options of a repo family (``[families.NAME.options]`` in a recipe)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(
        "builtin:repo/tasks.jsonl",
        min_length=1,
        description="JSONL task file (tree and task rows); 'builtin:NAME' is shipped in envs/data.",
    )
    wall_timeout_s: float = Field(60.0, gt=0, le=3600, description="Wall clock per test run.")
    cpu_limit_s: int = Field(60, ge=1, le=3600, description="CPU seconds per test run.")
    memory_bytes: int = Field(
        1 * 2**30, ge=128 * 2**20, le=2**36, description="Memory per test run."
    )
    eval_fraction: float = Field(
        0.2, ge=0, le=0.9, description="Share of tasks held out (by a hash of instance_id)."
    )


class Tree(BaseModel):
    """A tree row: a repository snapshot."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tree: str = Field(min_length=1, max_length=200)
    repo: str = Field(min_length=1, max_length=200)
    paths: list[str] = Field(default_factory=lambda: ["."], max_length=8)
    files: dict[str, str]


class RepoTask(BaseModel):
    """A task row (SWE-bench's fields; others are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    instance_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.=+-]+$")
    repo: str = Field(min_length=1)
    base: str = Field(min_length=1)
    problem_statement: str = Field(min_length=1)
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    patch: str = ""
    test_patch: str = ""
    base_patch: str = ""
    seed: int | None = None
    source: dict[str, Any] = Field(default_factory=dict)


class Loaded(BaseModel):
    """A task file: its tasks and trees, and one ``FILE:LINE: what is wrong`` per broken row."""

    tasks: dict[str, RepoTask]
    trees: dict[str, Tree]
    errors: list[str]


def _row(where: str, line: str, trees: dict[str, Tree]) -> RepoTask | Tree:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    try:
        if "tree" in row:
            tree = Tree.model_validate(row)
            for name in tree.files:
                sandbox.check_name(name)
            return tree
        task = RepoTask.model_validate(row)
    except ValidationError as exc:
        why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{where}: {why}") from None
    if task.base not in trees:
        raise ValueError(f"{where}: base tree {task.base!r} is not defined above")
    return task


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int) -> Loaded:
    tasks: dict[str, RepoTask] = {}
    trees: dict[str, Tree] = {}
    errors: list[str] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = _row(f"{path}:{lineno}", line, trees)
            except ValueError as exc:
                errors.append(str(exc))
                continue
            if isinstance(row, Tree):
                trees[row.tree] = row
            elif row.instance_id in tasks:
                errors.append(f"{path}:{lineno}: duplicate instance_id {row.instance_id!r}")
            else:
                tasks[row.instance_id] = row
    return Loaded(tasks=tasks, trees=trees, errors=errors)


def load(path: str) -> Loaded:
    """The task file at ``path`` (``builtin:NAME`` allowed), see the loading rule; ValueError
    when the file itself cannot be read."""
    p = resolve(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise ValueError(f"{p}: cannot read the task file: {exc.strerror}") from exc
    return _load(str(p), st.st_mtime_ns, st.st_size)


TEST_FOLDERS = ("tests", "test", "testing")


def is_test_file(path: str) -> bool:
    """A file of the tests, or of a tests folder (laid again from the base before scoring)."""
    *folders, name = path.split("/")
    if any(f in TEST_FOLDERS for f in folders):
        return True
    return _is_test_module(name)


def box(cfg: RepoConfig, isolation: sandbox.Mode) -> sandbox.SandboxConfig:
    """The sandbox of a test run: the family's limits and the test library."""
    return sandbox.SandboxConfig(
        wall_timeout_s=cfg.wall_timeout_s,
        cpu_limit_s=cfg.cpu_limit_s,
        memory_bytes=cfg.memory_bytes,
        max_processes=32,
        disk_bytes=64 * 2**20,
        max_file_bytes=8 * 2**20,
        max_output_bytes=64 * 2**10,
        isolation=isolation,
        library=(repo_tools.test_library(),),
    )


def base_files(task: RepoTask, tree: Tree) -> dict[str, str]:
    """The task's repository: the tree with ``base_patch`` applied."""
    return patches.apply(tree.files, task.base_patch)


def prepared(task: RepoTask, tree: Tree, patch: str) -> dict[str, str] | Verdict:
    """The tree to test: base + ``patch``, the tests laid again from the base, + test_patch;
    a 0 verdict saying why when the patch cannot be used or is refused (:mod:`patch_policy`)."""
    base = base_files(task, tree)
    try:
        files = patches.apply(base, patch)
    except patches.PatchError as exc:
        key = "patch.outside_repo" if exc.outside else "patch.does_not_apply"
        return Verdict(False, 0.0, f"the patch cannot be used: {exc}", {key: 1.0})
    for path in [p for p in files if is_test_file(p)]:
        del files[path]
    files.update({p: t for p, t in tree.files.items() if is_test_file(p)})
    refused = patch_policy.check(base, files)
    if refused:
        why = "; ".join(refused[:3]) + (f" (and {len(refused) - 3} more)" if refused[3:] else "")
        return Verdict(False, 0.0, f"the patch is refused: {why}", {"patch.refused": 1.0})
    try:
        return patches.apply(files, task.test_patch)
    except patches.PatchError as exc:
        return Verdict(False, 0.0, f"the task's test_patch does not apply: {exc}", error=str(exc))


def _is_test_module(name: str) -> bool:
    return name == "conftest.py" or name.startswith("test_") or name.endswith("_test.py")


def verdict_side(
    files: dict[str, str], paths: list[str], must: list[str]
) -> tuple[dict[str, str], list[str]]:
    """What the verdict side of a judged run holds itself: the test modules that ``must`` names,
    every ``.py`` file of the tests (``is_test_file``: conftests, helpers imported by their
    folder's name), and the ``__init__.py`` above them (by value, from ``files``, where they
    were laid again from the base); and the repository's other top-level module names, which
    it imports from the answer's process (:class:`repo_bridge.RemoteFinder`): a helper that is
    a top-level module of a source path among them (``import helpers`` with ``tests`` on
    ``paths``), whose own code uses the package as the package's does."""
    run = {t.split("::", 1)[0] for t in must}
    run |= {p for p in files if p.endswith(".py") and is_test_file(p)}
    above = {"/".join(p.split("/")[:i]) for p in run for i in range(1, p.count("/") + 1)}
    local = {
        p: t
        for p, t in files.items()
        if p in run
        or p.rsplit("/", 1)[-1] == "conftest.py"
        or (p.endswith("/__init__.py") and p.rsplit("/", 1)[0] in above)
    }
    modules: set[str] = set()
    for root in paths:
        prefix = "" if root in (".", "") else root.rstrip("/") + "/"
        for path in files:
            if not path.startswith(prefix) or not path.endswith(".py"):
                continue
            first, *rest = path[len(prefix) :].split("/")
            name = first[:-3] if not rest else first
            if (prefix + first in above) if rest else _is_test_module(first):
                continue
            if name.isidentifier():
                modules.add(name)
    return local, sorted(modules)


def _judged(
    files: dict[str, str], paths: list[str], must: list[str], b: sandbox.SandboxConfig, **extra: Any
) -> tuple[sandbox.SandboxResult, list[str]]:
    """A judged run of the tests ``must`` on ``files``: the result, and its lines that start
    with the run's nonce (the verdict side's, after the nonce)."""
    import secrets

    nonce = secrets.token_hex(16)
    local, modules = verdict_side(files, paths, must)
    params = {"nonce": nonce, "tests": must, "files": local, "modules": modules, **extra}
    result = sandbox.run(
        repo_tools.driver("verdict", paths, []),
        b,
        json.dumps(params),
        files,
        answer=repo_tools.driver("answer", paths, []),
    )
    said = [t[len(nonce) + 1 :] for t in result.stdout.splitlines() if t.startswith(nonce + " ")]
    return result, said


def judged_outcomes(
    files: dict[str, str], paths: list[str], tests: list[str], b: sandbox.SandboxConfig
) -> tuple[dict[str, str], str]:
    """Each of ``tests``' outcome in a judged run, and the run's verdict line or its status
    (building tasks: a test that does not pass apart from the package, e.g. one that patches
    the standard library, cannot judge one)."""
    result, said = _judged(files, paths, tests, b, outcomes=True)
    found = [json.loads(s[len("outcomes ") :]) for s in said if s.startswith("outcomes ")]
    line = next((s for s in reversed(said) if not s.startswith("outcomes ")), None)
    why = line or f"{result.status}: {result.reason or result.stderr.strip()[-300:]}"
    errors = [e for e in result.stderr.splitlines() if e.startswith("E ")]  # e.g. a conftest's
    if errors:
        why += f" ({errors[-1].removeprefix('E').strip()[:200]})"
    return ({str(k): str(v) for k, v in found[-1].items()} if found else {}), why


def run_tests(
    task: RepoTask, tree: Tree, files: dict[str, str], b: sandbox.SandboxConfig
) -> Verdict:
    """FAIL_TO_PASS and PASS_TO_PASS on ``files``, as a judged sandbox run."""
    result, said = _judged(files, tree.paths, [*task.FAIL_TO_PASS, *task.PASS_TO_PASS], b)
    line = next((s for s in reversed(said) if not s.startswith("outcomes ")), None)
    verdict = verdict_of(result, line)
    if result.status == "timeout":
        verdict.details["tests.timeout"] = 1.0
    return verdict


class RepoFamily(TaskFamily):
    """Repository tasks from a JSONL file (see the module docstring)."""

    plugin = "repo"
    Config = RepoConfig
    cfg: RepoConfig

    def __init__(self, name: str, cfg: RepoConfig) -> None:
        super().__init__(name, cfg)
        self.loaded = load(cfg.path)
        for error in self.loaded.errors:
            log.warning("repo family %s: %s", name, error)
        if not self.loaded.tasks:
            raise ValueError(f"{cfg.path}: no usable repo task ({len(self.loaded.errors)} broken)")
        self.splits: dict[Split, list[str]] = {"train": [], "eval": []}
        for iid in self.loaded.tasks:
            self.splits[hashed_split(iid, cfg.eval_fraction)].append(iid)

    def task(self, task_id: str) -> RepoTask:
        """The task behind ``NAME-SEED:INSTANCE_ID``; ValueError for a foreign id, and for a
        training seed naming a held-out task."""
        _seed, sep, iid = self.key(task_id).partition(":")
        if not sep or iid not in self.loaded.tasks:
            raise ValueError(f"task {task_id!r}: no problem {iid!r} in {self.cfg.path}")
        if self.split_of_task(task_id) == "train" and iid in self.splits["eval"]:
            raise ValueError(f"task {task_id!r}: {iid!r} is held-out (evaluation only)")
        return self.loaded.tasks[iid]

    def references(self) -> dict[str, str]:
        """Each task's reference ``patch``."""
        return {
            f"{self.name}-{EVAL_SEED_BASE}:{iid}": t.patch for iid, t in self.loaded.tasks.items()
        }

    def split_of_task(self, task_id: str) -> Split:
        return seed_split(self.key(task_id), task_id)

    def sample(self, seed: int, split: Split = "train") -> FamilyTask:
        if not 0 <= seed < EVAL_SEED_BASE:
            raise ValueError(f"repo seeds lie in [0, {EVAL_SEED_BASE}), not {seed}")
        rows = self.splits[split] or self.splits["train" if split == "eval" else "eval"]
        if not self.splits[split]:
            raise ValueError(f"{self.cfg.path}: no {split} tasks (see eval_fraction)")
        iid = rows[random.Random(seed).randrange(len(rows))]
        return self._task(seed + (EVAL_SEED_BASE if split == "eval" else 0), iid)

    def eval_tasks(self, n: int) -> list[FamilyTask]:
        return [self._task(EVAL_SEED_BASE + i, r) for i, r in enumerate(self.splits["eval"][:n])]

    def _task(self, seed: int, iid: str) -> FamilyTask:
        task = self.loaded.tasks[iid]
        spec = {"plugin": self.plugin, "path": str(resolve(self.cfg.path)), "instance_id": iid}
        prompt = repo_tools.prompt(task.problem_statement, task.repo)
        return FamilyTask(f"{self.name}-{seed}:{iid}", prompt, spec, seed)

    def score(self, task_id: str, completion: str, isolation: sandbox.Mode = "full") -> Verdict:
        task = self.task(task_id)
        return self.score_patch(task, self.answer(completion), isolation)

    def score_patch(self, task: RepoTask, patch: str, isolation: sandbox.Mode) -> Verdict:
        """Score ``patch`` for ``task`` (module rules)."""
        tree = self.loaded.trees[task.base]
        files = prepared(task, tree, patch)
        if isinstance(files, Verdict):
            return files
        return run_tests(task, tree, files, box(self.cfg, isolation))

    def format_check(self, task_id: str, completion: str) -> tuple[bool, str]:
        task = self.task(task_id)
        patch = self.answer(completion)
        if not patch.strip():
            return False, "empty patch"
        files = prepared(task, self.loaded.trees[task.base], patch)
        return (False, files.rationale) if isinstance(files, Verdict) else (True, "")

    def answer(self, completion: str) -> str:
        return completion

    @classmethod
    def environment(cls, spec: dict[str, Any]) -> Environment:
        loaded = load(str(spec["path"]))
        task = loaded.tasks[str(spec["instance_id"])]
        tree = loaded.trees[task.base]
        cfg = RepoConfig(path=str(spec["path"]))
        return repo_tools.environment(base_files(task, tree), tree.paths, box(cfg, "full"))


def shipped_path() -> Path:
    """The task file shipped with rlstream."""
    return DATA / "repo" / "tasks.jsonl"
