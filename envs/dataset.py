"""The ``dataset`` task family: coding problems from a local JSONL file, scored by their own tests.

Each line is one problem in the HumanEval/MBPP shape (``task_id``, ``prompt``, ``entry_point``,
``test``; optional ``canonical_solution``, ``visible_test``, ``split``); ``path = "builtin:NAME"``
reads ``envs/data/NAME`` shipped with rlstream (``mini_humaneval.jsonl``: 16 small problems).

Rules a maintainer must keep:
- loading checks every line and fails with ``FILE:LINE: what is wrong``, never half-loaded;
- no held-out problem is ever trained on: ``split_of`` decides by the ``split`` field, else by a
  stable hash of ``task_id``; ``sample`` draws training problems only, and a training id that
  names a held-out problem is refused;
- scoring runs the problem's own ``test`` as a judged sandbox run, so the verdict is out of the
  answer's reach; a sandbox that could not run is an ``error``, not a failure;
- the ``test`` tool runs the doctest examples and ``visible_test``, never ``test``.

Details: docs/task-families.md (The dataset family).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlstream.envs import sandbox, tools
from rlstream.envs.family import EVAL_SEED_BASE, FamilyTask, Split, TaskFamily, Verdict
from rlstream.envs.tools import Environment, Tool, ToolResult, Workspace
from rlstream.schemas.derive import derive
from rlstream.schemas.errors import RlstreamError

DATA = Path(__file__).resolve().parent / "data"
_DRIVER = Path(__file__).resolve().parent / "dataset_driver.py"
ToolName = Literal["python", "read", "write", "ls", "test"]
_FENCE = "```"


class DatasetError(RlstreamError, ValueError):
    """A dataset file that cannot be used, with ``FILE:LINE`` of the first problem found."""


class DatasetConfig(BaseModel):
    """Options of a dataset family (``[families.NAME.options]`` in a recipe)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(
        "builtin:mini_humaneval.jsonl",
        min_length=1,
        description="JSONL file of problems; 'builtin:NAME' is a file shipped in envs/data.",
    )
    wall_timeout_s: float = Field(10.0, gt=0, le=600, description="Wall clock per scoring run.")
    cpu_limit_s: int = Field(5, ge=1, le=600, description="CPU seconds per scoring run.")
    memory_bytes: int = Field(
        512 * 2**20, ge=64 * 2**20, le=2**36, description="Address space per process."
    )
    eval_fraction: float = Field(
        0.2,
        ge=0,
        le=0.9,
        description="Share of problems without a 'split' field held out (by a hash of task_id).",
    )
    packages: tuple[str, ...] = Field(
        (),
        max_length=32,
        description="Importable top-level modules of this environment the answers and tests "
        "may import (e.g. `more_itertools`), copied once into a read-only library the sandbox "
        "binds; only the standard library otherwise. Values crossing between the answer and "
        "the tests stay plain data (a package's own types do not cross).",
    )
    tools: tuple[ToolName, ...] = Field(
        ("python", "test", "read", "write", "ls"),
        min_length=1,
        description="Tools offered to the policy; the first is the default of a bare <run>.",
    )


@dataclass(frozen=True)
class Problem:
    """One line of the file."""

    task_id: str
    prompt: str
    entry_point: str
    test: str
    canonical_solution: str | None = None
    visible_test: str | None = None
    split: str | None = None


HELD_OUT_SPLITS = frozenset({"eval", "test", "validation", "valid", "heldout", "held_out"})
#: Split names that train; any other ``split`` value is refused (a typo would train silently).
TRAIN_SPLITS = frozenset({"train", "training"})


def split_of(problem: Problem, eval_fraction: float) -> Split:
    """The problem's split (see the module rules); the hash is sha256 of ``task_id``."""
    if problem.split is not None:
        return "eval" if problem.split.lower() in HELD_OUT_SPLITS else "train"
    return hashed_split(problem.task_id, eval_fraction)


def hashed_split(name: str, eval_fraction: float) -> Split:
    """``eval`` for the share ``eval_fraction`` of names, by sha256 of ``name`` (stable)."""
    digest = hashlib.sha256(name.encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") < eval_fraction * 2**64 else "train"


def seed_split(key: str, task_id: str) -> Split:
    """The split a ``SEED:ROW`` key's seed says: ``eval`` from ``EVAL_SEED_BASE`` up."""
    seed = key.partition(":")[0]
    if not seed.isdigit():
        raise ValueError(f"task {task_id!r}: the seed {seed!r} is not a number")
    return "eval" if int(seed) >= EVAL_SEED_BASE else "train"


def resolve(path: str) -> Path:
    """The file behind a ``path`` option (``builtin:NAME`` -> ``envs/data/NAME``)."""
    if path.startswith("builtin:"):
        return DATA / path.removeprefix("builtin:")
    return Path(path).expanduser().resolve()


def load(path: str | Path) -> dict[str, Problem]:
    """The problems of a JSONL file by ``task_id``, in file order (see the loading rule)."""
    p = resolve(str(path)) if isinstance(path, str) else path
    try:
        st = p.stat()
    except OSError as exc:
        raise DatasetError(f"{p}: cannot read the dataset: {exc.strerror}") from exc
    return _load(str(p), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int, size: int) -> dict[str, Problem]:
    problems: dict[str, Problem] = {}
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                problem = parse_line(line, f"{path}:{lineno}")
                if problem.task_id in problems:
                    raise DatasetError(f"{path}:{lineno}: duplicate task_id {problem.task_id!r}")
                problems[problem.task_id] = problem
    if not problems:
        raise DatasetError(f"{path}: no problems in the file")
    return problems


def parse_line(line: str, where: str) -> Problem:
    """One problem; DatasetError naming ``where`` and the field for anything wrong."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object")
    for name in ("task_id", "prompt", "entry_point", "test"):
        if not isinstance(row.get(name), str) or not row[name]:
            raise DatasetError(f"{where}: field {name!r} must be a non-empty string")
    for name in ("canonical_solution", "visible_test", "split"):
        if row.get(name) is not None and not isinstance(row[name], str):
            raise DatasetError(f"{where}: field {name!r} must be a string")
    split = row.get("split")
    if split is not None and split.lower() not in HELD_OUT_SPLITS | TRAIN_SPLITS:
        known = ", ".join(sorted(HELD_OUT_SPLITS | TRAIN_SPLITS))
        raise DatasetError(f"{where}: split {split!r} is none of {known}")
    if not row["entry_point"].isidentifier():
        raise DatasetError(f"{where}: entry_point {row['entry_point']!r} is not an identifier")
    return Problem(
        row["task_id"],
        row["prompt"],
        row["entry_point"],
        row["test"],
        row.get("canonical_solution"),
        row.get("visible_test"),
        row.get("split"),
    )


# ---------------------------------------------------------------- answers and programs


def answer_of(completion: str) -> str:
    """The scored part of a completion (see the module rules)."""
    text = completion
    for tag in ("</out>", "</sum>"):
        if tag in text:
            text = text.rsplit(tag, 1)[1]
    text = text.replace("\r\n", "\n").rstrip()
    if _FENCE in text:
        inside = text.split(_FENCE, 2)[1]
        text = inside.split("\n", 1)[1] if "\n" in inside else inside
        text = text.rstrip()
    text = text.lstrip("\n")
    lines = text.split("\n")
    starts = ("def ", "class ", "import ", "from ", "@", "async def ")
    if text and not any(ln[:1] in (" ", "\t") for ln in lines) and not text.startswith(starts):
        text = "\n".join("    " + ln if ln else ln for ln in lines)
    return text + "\n" if text else ""


def program_of(problem: Problem, answer: str) -> str:
    """``prompt + answer``, or the answer alone when the prompt is not Python."""
    prompt = problem.prompt
    try:
        compile(prompt, "<prompt>", "exec")
    except SyntaxError:
        return answer
    return prompt + ("" if prompt.endswith("\n") else "\n") + answer


@functools.cache
def driver_source(
    entry_point: str, role: Literal["verdict", "answer"] = "verdict", library: str | None = None
) -> str:
    """The sandboxed test driver for one entry point, as the verdict side or the answer's,
    with the read-only ``library`` folder (the family's ``packages``) after the standard
    library on its path."""
    source = _DRIVER.read_text(encoding="utf-8")
    source = source.replace('\nENTRY = "f"\n', f"\nENTRY = {entry_point!r}\n", 1)
    if library is not None:
        if "\nLIBRARY = None\n" not in source:
            raise RuntimeError(f"{_DRIVER} lost its LIBRARY line")
        source = source.replace("\nLIBRARY = None\n", f"\nLIBRARY = {library!r}\n", 1)
    return source.replace('\nROLE = "verdict"\n', f"\nROLE = {role!r}\n", 1)


def run_driver(
    problem: Problem, program: str, mode: str, box: sandbox.SandboxConfig
) -> tuple[sandbox.SandboxResult, str | None]:
    """Run the driver as a judged run (the verdict side and the answer's process apart);
    (result, the verdict line's text after the nonce, or None if absent)."""
    nonce = secrets.token_hex(16)
    params = {
        "nonce": nonce,
        "mode": mode,
        "prompt": problem.prompt,
        "test": problem.test if mode == "hidden" else "",
        "visible_test": problem.visible_test or "",
    }
    files = {"solution.py": program}
    library = box.library[0] if box.library else None
    result = sandbox.run(
        driver_source(problem.entry_point, "verdict", library),
        box,
        json.dumps(params),
        files,
        answer=driver_source(problem.entry_point, "answer", library),
    )
    verdict = None
    for line in result.stdout.splitlines():
        if line.startswith(nonce + " "):
            verdict = line[len(nonce) + 1 :]
    return result, verdict


def verdict_of(result: sandbox.SandboxResult, line: str | None) -> Verdict:
    """Map a driver run to a Verdict (rule: pass only on exit 0 with the nonce's pass line)."""
    details = {"wall_ms": round(result.wall_s * 1000, 1), "cpu_ms": round(result.cpu_s * 1000, 1)}
    if result.status == "error":
        return Verdict(False, 0.0, result.reason, details, result.mode, error=result.reason)
    if result.status == "ok" and line == "pass":
        return Verdict(True, 1.0, "all tests pass", details, result.mode)
    if line is not None and line.startswith("fail "):
        why = line.removeprefix("fail ")
    else:
        tail = (result.stderr.strip().splitlines() or [""])[-1][:300]
        why = f"{result.status}: {result.reason or tail or 'no verdict'}"
    return Verdict(False, 0.0, why, details, result.mode)


# ---------------------------------------------------------------- the family


def _test_tool(spec: dict[str, Any]) -> Tool:
    problem = Problem(
        str(spec["row"]), str(spec["prompt"]), str(spec["entry_point"]), "",
        visible_test=spec.get("visible_test"),
    )  # fmt: skip

    packages = tuple(spec.get("packages") or ())

    def run(workspace: Workspace, arg: str, box: sandbox.SandboxConfig) -> ToolResult:
        program = workspace.files.get("solution.py", b"").decode("utf-8", errors="replace")
        if packages:  # the family's packages, as its scoring runs have them
            box = derive(box, library=(sandbox.library_of(packages),))
        result, line = run_driver(problem, program, "visible", box)
        if line is not None:  # the driver ran the tests: its report, without the verdict line
            text = result.stdout.rsplit("\n", 2)[0]
        else:
            text = result.stdout + result.stderr + f"[{result.status}]"
        return ToolResult(
            text.strip() or "no visible tests", "ok" if line == "pass" else "error", result.mode
        )

    return Tool("test", "@test (runs the visible tests on solution.py)", run, ())


class DatasetFamily(TaskFamily):
    """Problems from a JSONL file in the HumanEval/MBPP shape (see the module docstring)."""

    plugin = "dataset"
    Config = DatasetConfig
    cfg: DatasetConfig

    def __init__(self, name: str, cfg: DatasetConfig) -> None:
        super().__init__(name, cfg)
        self.problems = self.load_problems(cfg)
        self.order = list(self.problems)
        self.splits: dict[Split, list[str]] = {"train": [], "eval": []}
        for row, problem in self.problems.items():
            self.splits[split_of(problem, cfg.eval_fraction)].append(row)
        self.held_out = frozenset(self.splits["eval"])
        try:  # made once per process (cached by the set of modules)
            if cfg.packages:
                sandbox.library_of(cfg.packages)
        except ValueError as exc:  # at the recipe's load: every role says so before it runs
            raise ValueError(f"packages: {exc}") from None

    def load_problems(self, cfg: DatasetConfig) -> dict[str, Problem]:
        """The family's problems by ``task_id``: the file at ``cfg.path``. A family of problems
        made another way (generated, fetched) subclasses this one and overrides this alone:
        sampling, splits, tools and the sandboxed verdict come with it (docs/examples)."""
        return load(cfg.path)

    def problem(self, task_id: str) -> Problem:
        """The problem behind ``task_id`` (``NAME-SEED:ROW``); ValueError for a foreign id, and
        for a training seed naming a held-out problem (those are scored in evaluation only)."""
        _seed, sep, row = self.key(task_id).partition(":")
        if not sep or row not in self.problems:
            raise ValueError(f"task {task_id!r}: no problem {row!r} in {self.cfg.path}")
        problem = self.problems[row]
        if self.split_of_task(task_id) == "train" and row in self.held_out:
            raise ValueError(
                f"task {task_id!r}: problem {row!r} is held-out; it is scored in evaluation "
                f"only (seeds from {EVAL_SEED_BASE}), never as a training task"
            )
        return problem

    def split_of_task(self, task_id: str) -> Split:
        """``eval`` for an evaluation seed (``EVAL_SEED_BASE`` and up), else ``train``."""
        return seed_split(self.key(task_id), task_id)

    def references(self) -> dict[str, str]:
        """Each problem's ``canonical_solution`` (problems without one are left unchecked)."""
        return {
            f"{self.name}-{EVAL_SEED_BASE}:{row}": p.canonical_solution
            for row, p in self.problems.items()
            if p.canonical_solution
        }

    def sample(self, seed: int, split: Split = "train") -> FamilyTask:
        """A problem of ``split`` drawn from ``seed`` (in ``[0, EVAL_SEED_BASE)``); held-out
        tasks get the seed ``EVAL_SEED_BASE + seed``, so their ids say they are held out."""
        if not 0 <= seed < EVAL_SEED_BASE:
            raise ValueError(f"dataset seeds lie in [0, {EVAL_SEED_BASE}), not {seed}")
        rows = self.splits[split]
        if not rows:
            raise ValueError(f"{self.cfg.path}: no {split} problems (see split, eval_fraction)")
        problem = self.problems[rows[random.Random(seed).randrange(len(rows))]]
        return self._task(seed + (EVAL_SEED_BASE if split == "eval" else 0), problem)

    def eval_tasks(self, n: int) -> list[FamilyTask]:
        """The first ``n`` held-out problems in file order, each once."""
        rows = self.splits["eval"][:n]
        return [self._task(EVAL_SEED_BASE + i, self.problems[r]) for i, r in enumerate(rows)]

    def _task(self, seed: int, problem: Problem) -> FamilyTask:
        spec = {
            "plugin": self.plugin,
            "row": problem.task_id,
            "prompt": problem.prompt,
            "entry_point": problem.entry_point,
            "visible_test": problem.visible_test,
            "tools": list(self.cfg.tools),
            **({"packages": list(self.cfg.packages)} if self.cfg.packages else {}),
        }
        return FamilyTask(f"{self.name}-{seed}:{problem.task_id}", problem.prompt, spec, seed)

    def sandbox_config(self, isolation: sandbox.Mode) -> sandbox.SandboxConfig:
        return sandbox.SandboxConfig(
            wall_timeout_s=self.cfg.wall_timeout_s,
            cpu_limit_s=self.cfg.cpu_limit_s,
            memory_bytes=self.cfg.memory_bytes,
            isolation=isolation,
            library=(sandbox.library_of(self.cfg.packages),) if self.cfg.packages else (),
        )

    def score(self, task_id: str, completion: str, isolation: sandbox.Mode = "full") -> Verdict:
        return self.score_problem(self.problem(task_id), self.answer(completion), isolation)

    def score_problem(self, problem: Problem, answer: str, isolation: sandbox.Mode) -> Verdict:
        """Score an answer (already extracted) against ``problem``'s own tests."""
        if not answer.strip():
            return Verdict(False, 0.0, "empty answer")
        program = program_of(problem, answer)
        result, line = run_driver(problem, program, "hidden", self.sandbox_config(isolation))
        return verdict_of(result, line)

    def format_check(self, task_id: str, completion: str) -> tuple[bool, str]:
        problem = self.problem(task_id)  # ValueError for a foreign or held-out task
        answer = self.answer(completion)
        if not answer.strip():
            return False, "empty answer"
        if "<run>" in answer or "<out>" in answer:
            return False, "tool tag in the answer"
        try:
            compile(program_of(problem, answer), "<answer>", "exec")
        except (SyntaxError, ValueError) as exc:
            return False, f"does not compile: {getattr(exc, 'msg', exc)}"
        return True, ""

    def answer(self, completion: str) -> str:
        return answer_of(completion)

    @classmethod
    def environment(cls, spec: dict[str, Any]) -> Environment:
        by_name = {
            "python": tools.PYTHON,
            "read": tools.READ,
            "write": tools.WRITE,
            "ls": tools.LS,
            "test": _test_tool(spec),
        }
        chosen = tuple(by_name[n] for n in spec.get("tools") or by_name if n in by_name)
        return Environment(chosen, {"solution.py": str(spec["prompt"])})


def shipped() -> list[str]:
    """The dataset files shipped with rlstream (``builtin:NAME``)."""
    return sorted(f"builtin:{n}" for n in os.listdir(DATA) if n.endswith(".jsonl"))
