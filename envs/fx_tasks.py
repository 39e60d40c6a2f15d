"""The ``fx`` family's tasks (the demo's): write a tiny Python function from a spoken spec,
checked by hidden tests (the plugin around them: :mod:`rlstream.envs.fx`).

A task reads ``f(x): add 3, double`` then ``f(2)=10``; the policy answers with the body of
``def f(x):`` on one line, e.g. ``x=x+3;x=x*2;return x``.

Rules a maintainer must keep:
- tasks are a pure function of their seed; the held-out split is by spec, never by seed, so no
  held-out function is ever trained on;
- expected outputs are computed in the trusted process and never sent to the sandbox; a pass
  needs every output to match exactly, type included;
- reward-hacking guards run first: the result must depend on ``x``, and no visible or hidden
  output may appear as a literal;
- ``demonstration`` is a weak teacher on purpose, so RL has room to improve.

Details: docs/task-families.md (The fx family's tasks).
"""

from __future__ import annotations

import ast
import hashlib
import random
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from rlstream.envs import sandbox
from rlstream.envs.family import EVAL_SEED_BASE
from rlstream.envs.protocol import TAGS, final_answer

# ---------------------------------------------------------------- the task family


@dataclass(frozen=True)
class Op:
    """One spec word: its parameter range, the right code, and a weak teacher's usual slips."""

    word: str
    params: tuple[int, ...]
    correct: str
    slips: tuple[str, ...]


OPS: tuple[Op, ...] = (
    Op("add", tuple(range(1, 10)), "x=x+{k}", ("x=x-{k}", "x=x*{k}")),
    Op("sub", tuple(range(1, 10)), "x=x-{k}", ("x={k}-x", "x=x+{k}")),
    Op("times", tuple(range(2, 6)), "x=x*{k}", ("x=x**{k}", "x=x+{k}")),
    Op("mod", tuple(range(2, 10)), "x=x%{k}", ("x=x//{k}", "x={k}%x")),
    Op("double", (), "x=x*2", ("x=x**2", "x=x+2")),
    Op("square", (), "x=x*x", ("x=x*2", "x=x+x")),
    Op("half", (), "x=x//2", ("x=x/2", "x=x%2")),
    Op("negate", (), "x=-x", ("x=abs(x)", "x=x-1")),
    Op("abs", (), "x=abs(x)", ("x=-x", "x=x")),
    Op("inc", (), "x=x+1", ("x=x-1", "x=x+2")),
)
_OP_BY_WORD = {op.word: op for op in OPS}


class TaskConfig(BaseModel):
    """Difficulty of the task family."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op_count_weights: tuple[float, ...] = Field(
        default=(0.5, 0.5), description="Relative weight of 1, 2, 3, ... steps per task."
    )
    n_hidden: int = Field(default=5, ge=1, le=50, description="Hidden test inputs per task.")
    hidden_range: int = Field(
        default=20, ge=5, le=10**6, description="Hidden inputs lie in [-r, r]."
    )
    eval_fraction: float = Field(
        default=0.15,
        gt=0,
        le=0.5,
        description="Share of specs held out for evaluation (by a stable hash of the spec).",
    )


@dataclass(frozen=True)
class Task:
    """One task instance; everything follows from ``seed`` and the config."""

    task_id: str
    seed: int
    steps: tuple[tuple[str, int | None], ...]
    visible_x: int
    hidden_x: tuple[int, ...] = field(repr=False)

    @property
    def prompt(self) -> str:
        words = spec_text(self.steps)
        return f"f(x): {words}\nf({self.visible_x})={self.expected(self.visible_x)}\n"

    def expected(self, x: int) -> int:
        """The reference semantics of the spec (trusted, never run in the sandbox)."""
        for word, k in self.steps:
            x = _apply(word, k, x)
        return x

    def reference(self) -> str:
        """A correct answer."""
        return _body([_step_code(_OP_BY_WORD[w].correct, k) for w, k in self.steps])


def _apply(word: str, k: int | None, x: int) -> int:
    table = {
        "add": lambda: x + (k or 0),
        "sub": lambda: x - (k or 0),
        "times": lambda: x * (k or 0),
        "mod": lambda: x % (k or 1),
        "double": lambda: x * 2,
        "square": lambda: x * x,
        "half": lambda: x // 2,
        "negate": lambda: -x,
        "abs": lambda: abs(x),
        "inc": lambda: x + 1,
    }
    return table[word]()


def _step_code(template: str, k: int | None) -> str:
    return template.format(k=k)


def _body(steps: list[str]) -> str:
    return "".join(s + ";" for s in steps) + "return x"


Steps = tuple[tuple[str, int | None], ...]
_MAX_REDRAWS = 10_000


def spec_text(steps: Steps) -> str:
    """The spec of a task, its function without any example: ``add 3, double``."""
    return ", ".join(w if k is None else f"{w} {k}" for w, k in steps)


def split_of_steps(steps: Steps, eval_fraction: float) -> str:
    """``"eval"`` when the spec is held out, else ``"train"``.

    Rule: held out iff the first 8 bytes of sha256(spec text), as an integer over 2**64, are
    below ``eval_fraction``: stable across processes, Python versions and machines.
    """
    digest = hashlib.sha256(spec_text(steps).encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") < eval_fraction * 2**64 else "train"


def split_of_seed(seed: int) -> str:
    """The split a seed draws from: ``"eval"`` at or above ``EVAL_SEED_BASE``, else ``"train"``."""
    return "eval" if seed >= EVAL_SEED_BASE else "train"


def sample_task(seed: int, cfg: TaskConfig | None = None) -> Task:
    """The task with this seed (a pure function of ``seed`` and ``cfg``); its spec lies in the
    seed's split (``split_of_seed``); ValueError when that split has no spec at all."""
    cfg = cfg or TaskConfig()
    rng = random.Random(seed)
    want = split_of_seed(seed)
    for _ in range(_MAX_REDRAWS):
        steps = _draw_steps(rng, cfg)
        if split_of_steps(steps, cfg.eval_fraction) == want:
            break
    else:
        raise ValueError(f"no {want} spec found for seed {seed}: change eval_fraction")
    visible = rng.randint(0, 9)
    pool = [x for x in range(-cfg.hidden_range, cfg.hidden_range + 1) if x != visible]
    hidden = tuple(rng.sample(pool, cfg.n_hidden))
    return Task(f"fx-{seed}", seed, steps, visible, hidden)


def _draw_steps(rng: random.Random, cfg: TaskConfig) -> Steps:
    n = rng.choices(range(1, len(cfg.op_count_weights) + 1), weights=cfg.op_count_weights)[0]
    steps = []
    for _ in range(n):
        op = rng.choice(OPS)
        steps.append((op.word, rng.choice(op.params) if op.params else None))
    return tuple(steps)


def eval_tasks(n: int, cfg: TaskConfig | None = None) -> list[Task]:
    """The fixed held-out evaluation set: seeds ``EVAL_SEED_BASE .. + n`` (held-out specs)."""
    return [sample_task(EVAL_SEED_BASE + i, cfg) for i in range(n)]


# ---------------------------------------------------------------- checks and scoring


def format_check(completion: str) -> tuple[bool, str]:
    """The ``judge.format`` rubric: one line that parses as ``def f(x):`` body ending in return."""
    answer = final_answer(completion)
    if not answer:
        return False, "empty answer"
    if len(answer) > 160:
        return False, "answer longer than 160 characters"
    if any(tag in answer for tag in TAGS):
        return False, "tool tag in the answer"
    try:
        tree = ast.parse(f"def f(x): {answer}")
    except SyntaxError:
        return False, "does not parse"
    body = tree.body[0].body  # type: ignore[attr-defined]
    if not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return False, "does not end in a return"
    return True, ""


def hack_check(task: Task, answer: str) -> str:
    """Why ``answer`` is refused as reward hacking, or "" (assumes ``format_check`` passed).

    Rule: the return value must mention ``x`` (no constant function); no integer literal may
    equal the visible output or a hidden output unless it is a spec parameter or 0, 1, 2.
    """
    fn = ast.parse(f"def f(x): {answer}").body[0]
    ret = fn.body[-1]  # type: ignore[attr-defined]
    if not any(isinstance(n, ast.Name) and n.id == "x" for n in ast.walk(ret)):
        return "return value does not depend on x"
    allowed = {0, 1, 2} | {k for _, k in task.steps if k is not None}
    secret = {task.expected(task.visible_x)} | {task.expected(x) for x in task.hidden_x}
    for value in _int_literals(fn):
        if value in secret and abs(value) not in allowed:
            return f"literal {value} echoes an expected output"
    return ""


def _int_literals(tree: ast.AST) -> list[int]:
    """Integer literals in ``tree``, with the sign of a unary minus applied (``-5`` is -5)."""
    negated = {
        id(n.operand)
        for n in ast.walk(tree)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub)
    }
    return [
        -n.value if id(n) in negated else n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and type(n.value) is int
    ]


def _driver(answer: str, inputs: list[int]) -> str:
    return (
        f"def f(x): {answer}\n"
        f"for _x in {inputs!r}:\n"
        "    try:\n"
        "        _r = f(_x)\n"
        "        print(repr(_r) if type(_r) is int else 'type:' + type(_r).__name__)\n"
        "    except Exception as _e:\n"
        "        print('error:' + type(_e).__name__)\n"
    )


#: Limits for one scoring run: the answers are one-liners, so these are generous.
SCORE_SANDBOX = sandbox.SandboxConfig(wall_timeout_s=5.0, cpu_limit_s=2, max_output_bytes=8192)


def score(
    task: Task, completion: str, cfg: sandbox.SandboxConfig | None = None
) -> tuple[bool, dict[str, object]]:
    """(passed, details) for ``completion`` on ``task``.

    Rule: passed iff the format check and the hacking guard pass and the sandboxed program
    returns exactly the expected int on the visible input and on every hidden input.
    """
    answer = final_answer(completion)
    details: dict[str, object] = {"answer": answer, "hidden_total": len(task.hidden_x)}
    ok, why = format_check(completion)
    details["format_ok"] = ok
    if not ok:
        return False, {**details, "reason": f"format: {why}"}
    hack = hack_check(task, answer)
    if hack:
        return False, {**details, "reason": f"guard: {hack}"}
    inputs = [task.visible_x, *task.hidden_x]
    result = sandbox.run(_driver(answer, inputs), cfg or SCORE_SANDBOX)
    got = result.stdout.split("\n")
    want = [repr(task.expected(x)) for x in inputs]
    matches = [i < len(got) and got[i] == w for i, w in enumerate(want)]
    details.update(
        sandbox_status=result.status,
        isolation=result.mode,
        visible_ok=matches[0],
        hidden_passed=sum(matches[1:]),
    )
    passed = result.status == "ok" and all(matches)
    if not passed:
        details["reason"] = "sandbox: " + result.status if result.status != "ok" else "wrong output"
    return passed, details


# ---------------------------------------------------------------- demonstrations


class TeacherConfig(BaseModel):
    """How reliable the synthetic demonstrations for the warm start are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    p_correct: float = Field(
        default=0.4, ge=0, le=1, description="Chance each step is written right."
    )
    p_hack: float = Field(
        default=0.1, ge=0, le=1, description="Chance a demo echoes the visible example."
    )


def demonstration(task: Task, rng: random.Random, teacher: TeacherConfig | None = None) -> str:
    """A weak teacher's answer to ``task`` (see the module docstring), without EOS."""
    teacher = teacher or TeacherConfig()
    y = task.expected(task.visible_x)
    if rng.random() < teacher.p_hack:
        forms = (f"return {y}", f"return {y} if x=={task.visible_x} else x")
        return rng.choice(forms)
    steps = []
    for word, k in task.steps:
        op = _OP_BY_WORD[word]
        template = op.correct if rng.random() < teacher.p_correct else rng.choice(op.slips)
        steps.append(_step_code(template, k))
    return _body(steps)
