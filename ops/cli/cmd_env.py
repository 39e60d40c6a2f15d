"""``rlstream env``: task families and the sandbox, without Kafka.

- ``env score --tasks FILE.jsonl --answers FILE.jsonl [--json]`` scores a file of answers
  (``task_id``, ``completion`` per line) against a dataset in the HumanEval/MBPP shape, through
  the dataset family, the sandbox and the ``tests`` judge the pipeline uses: one line per answer
  (``task_id``, ``passed``, ``reward``, ``isolation``, ``detail``, ``error``) and a last summary
  line (``tasks``, ``passed``, ``errors``). ``--canonical`` scores the file's own
  ``canonical_solution``s instead (a dataset's self-check: a task whose reference fails, a
  missing one included, is named on stderr, counted as ``broken``, and the exit status is 1).
  A bad answer line is reported as an error line and the others are still scored; exit status
  0 when nothing was an error or broken, 1 when some line was, 2 when the tasks file itself is
  unusable.
  Repo tasks (a ``repo`` task file, SWE-bench's shape, ``envs.repo``) are scored the same way:
  answers are SWE-bench predictions (``instance_id``, ``patch`` per line; ``task_id`` and
  ``completion`` are accepted too), ``--canonical`` applies each task's reference ``patch`` and
  ``--unpatched`` scores the empty patch (every task must fail). A broken task row is reported
  as ``FILE:LINE: what is wrong`` on stderr, the rest are scored, and the exit status is 1.
- ``env score --family NAME --answers FILE [--recipe RECIPE | --options JSON]`` scores answers
  with any task family, a plugin's included: the recipe's family of that name, or the installed
  plugin ``NAME`` with ``--options``; the answers carry the pipeline's task ids (``NAME-KEY``).
- ``env build-repo-tasks --packages A,B,C --count N --out FILE [--seed S] [--json]`` builds repo
  tasks from the packages' sdists (``envs.repo_build``; ``pip download`` at build time only),
  writes them to FILE and ends with ``{"tasks", "packages", "by_package", "failed", "kept",
  "dropped"}``; ``failed`` says why each package left out yields nothing (exit status 2 when
  none yields anything, 1 when fewer than N tasks were built).
- ``env isolation`` says which sandbox modes work on this machine, and why the others do not.
- ``env families`` lists the registered task-family plugins.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    env = sub.add_parser("env", help="task families and the sandbox, without Kafka")
    cmds = env.add_subparsers(dest="env_command", metavar="ENV_COMMAND", required=True)
    score = cmds.add_parser("score", help="score answers against a JSONL dataset's own tests")
    score.add_argument("--tasks", help="JSONL problems (task_id, prompt, ...) or repo tasks")
    score.add_argument(
        "--family",
        metavar="NAME",
        help="score with task family NAME instead of a tasks file: the recipe's family of that "
        "name (--recipe), else the installed plugin NAME with --options; answers carry the "
        "pipeline's task ids (NAME-KEY)",
    )
    score.add_argument(
        "--recipe", help="the recipe (file or shipped name) whose family --family is"
    )
    score.add_argument("--options", default="{}", help="plugin options as JSON (with --family)")
    answers = score.add_mutually_exclusive_group(required=True)
    answers.add_argument("--answers", help="JSONL answers (task_id, completion)")
    answers.add_argument(
        "--canonical",
        action="store_true",
        help="score the tasks' canonical_solution (repo tasks: their reference patch)",
    )
    answers.add_argument(
        "--unpatched", action="store_true", help="repo tasks: score the empty patch"
    )
    score.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    score.add_argument("--jobs", type=int, default=2, help="sandboxes run at once (default 2)")
    score.add_argument(
        "--isolation",
        choices=["full", "userns", "rlimits"],
        default="full",
        help="weakest sandbox isolation accepted (default full: refuse anything less)",
    )
    score.add_argument("--timeout", type=float, default=10.0, help="wall seconds per answer")
    score.set_defaults(func=_score)
    build = cmds.add_parser("build-repo-tasks", help="build repo tasks from packages' sdists")
    build.add_argument("--packages", required=True, help="comma-separated: NAME or NAME==VER")
    build.add_argument("--count", type=int, required=True, help="tasks to build")
    build.add_argument("--out", required=True, help="JSONL file to write")
    build.add_argument("--seed", type=int, default=0, help="mutation sites drawn with it")
    build.add_argument("--json", action="store_true", help="progress lines as JSON")
    build.set_defaults(func=_build_repo_tasks)
    iso = cmds.add_parser("isolation", help="which sandbox isolation modes work here")
    iso.add_argument("--json", action="store_true")
    iso.set_defaults(func=_isolation)
    fam = cmds.add_parser("families", help="registered task-family plugins")
    fam.add_argument("--json", action="store_true")
    fam.set_defaults(func=_families)


def read_answers(path: str) -> list[tuple[str, str | None, str | None]]:
    """(where, task_id, completion) per non-blank line; task_id None when the line is bad,
    with the reason in place of the completion."""
    out: list[tuple[str, str | None, str | None]] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                out.append((where, None, f"not JSON ({exc.msg})"))
                continue
            if isinstance(row, dict) and "instance_id" in row and "task_id" not in row:
                row = {"task_id": row["instance_id"], "completion": row.get("patch")}
            if not isinstance(row, dict) or not isinstance(row.get("task_id"), str):
                out.append((where, None, "expected an object with a string task_id"))
            elif not isinstance(row.get("completion"), str):
                out.append((where, row["task_id"], None))
            else:
                out.append((where, row["task_id"], row["completion"]))
    return out


def score_one(
    where: str, task_id: str | None, completion: str | None, cfg: Any, as_given: bool = False
) -> dict[str, Any]:
    """One output line: the ``tests`` judge's verdict on one answer, or why it has none.
    ``as_given``: the task id is the pipeline's own (``--family``), else a file's problem id."""
    from rlstream.envs.judges import judge_tests

    if task_id is None or completion is None:
        why = completion if task_id is None else "field 'completion' must be a string"
        return _line(task_id, False, 0.0, "not_run", f"{where}: {why}", True)
    from rlstream.envs.family import EVAL_SEED_BASE

    # scoring a file is evaluation: an evaluation seed, so held-out problems are scored too
    full = task_id if as_given else f"env-{EVAL_SEED_BASE}:{task_id}"
    task = {"task_id": full, "completion": completion}
    reward = judge_tests(task, cfg)
    isolation = next(
        (k.removeprefix("isolation.") for k in reward["details"] if k.startswith("isolation.")),
        "not_run",
    )
    detail = reward.get("error") or reward["rationale"]
    if "error" in reward and "no problem" in detail:
        detail = f"{where}: unknown task_id {task_id!r}"
    return _line(task_id, reward["passed"], reward["score"], isolation, detail, "error" in reward)


def _line(
    task_id: str | None, passed: bool, reward: float, isolation: str, detail: str, error: bool
) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "passed": passed,
        "reward": reward,
        "isolation": isolation,
        "detail": detail,
        "error": error,
    }


def _family_spec(args: argparse.Namespace) -> Any:
    """The family ``--family NAME`` scores with: the recipe's, or the plugin NAME's."""
    from rlstream.envs.family import FamilySpec

    if args.recipe:
        from rlstream.ops.run.config import find_recipe, load_run_config

        families = load_run_config(find_recipe(args.recipe), []).run_families()
        if args.family not in families:
            raise ValueError(
                f"the recipe has no family {args.family!r} (families: {', '.join(families)})"
            )
        return families[args.family]
    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--options is not JSON: {exc.msg}") from None
    if args.tasks:
        options.setdefault("path", args.tasks)
    return FamilySpec(plugin=args.family, options=options)


def _todo(args: argparse.Namespace) -> tuple[Any, list[Any], list[str]]:
    """(judge config, (where, task_id, answer) to score, broken task rows) of ``env score``."""
    from rlstream.envs import family as task_families
    from rlstream.envs import repo
    from rlstream.envs.dataset import load, resolve
    from rlstream.envs.family import FamilySpec
    from rlstream.envs.judges import JudgeConfig

    if args.family:
        if args.unpatched:
            raise ValueError("--unpatched is for repo task files")
        spec = _family_spec(args)
        fam = task_families.families({args.family: spec})[args.family]  # or say why not
        cfg = JudgeConfig(
            kind="tests",
            families={args.family: spec},
            isolation=args.isolation,
            evaluation=True,
        )
        if args.answers:
            return cfg, read_answers(args.answers), []
        refs = fam.references()
        if not refs:
            raise ValueError(f"family {args.family!r} has no reference answers to check")
        return cfg, [(f"{args.family} {t}", t, ref) for t, ref in refs.items()], []
    if not args.tasks:
        raise ValueError("give --tasks FILE, or --family NAME")
    if _is_repo_file(args.tasks):
        loaded = repo.load(args.tasks)
        options: dict[str, Any] = {"path": str(resolve(args.tasks)), "eval_fraction": 0.0}
        options["wall_timeout_s"] = max(args.timeout, 60.0)
        spec = FamilySpec(plugin="repo", options=options)
        answers = {
            t.instance_id: (t.patch if args.canonical else "") for t in loaded.tasks.values()
        }
        todo = [(f"{args.tasks} {i}", i, a) for i, a in answers.items()]
        errors = loaded.errors
    else:
        if args.unpatched:
            raise ValueError("--unpatched is for repo task files")
        problems = load(args.tasks)
        options = {"path": str(resolve(args.tasks)), "wall_timeout_s": args.timeout}
        spec = FamilySpec(plugin="dataset", options=options)
        todo = [
            (f"{args.tasks} {p.task_id}", p.task_id, p.canonical_solution or "")
            for p in problems.values()
        ]
        errors = []
    cfg = JudgeConfig(
        kind="tests", families={"env": spec}, isolation=args.isolation, evaluation=True
    )
    if not (args.canonical or args.unpatched):
        todo = read_answers(args.answers)  # type: ignore[assignment]
    return cfg, todo, errors


def _is_repo_file(path: str) -> bool:
    """A repo task file: its first row is a tree or a task in SWE-bench's shape."""
    from rlstream.envs.dataset import resolve

    with open(resolve(path), encoding="utf-8") as fh:
        first = next((line for line in fh if line.strip()), "")
    return first.lstrip().startswith("{") and ('"tree"' in first or '"instance_id"' in first)


def _score(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from rlstream.envs.dataset import DatasetError

    try:
        cfg, todo, errors = _todo(args)
    except (DatasetError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    broken: list[str] = []  # a self-check's tasks that cannot be trained on, and why
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        as_given = bool(args.family)
        lines = pool.map(lambda t: score_one(t[0], t[1], t[2], cfg, as_given), todo)
        summary = {"tasks": 0, "passed": 0, "errors": 0}
        for line in lines:
            summary["tasks"] += 1
            summary["passed"] += line["passed"]
            summary["errors"] += line["error"]
            _print_line(line, args.json)
            if args.canonical and not line["passed"]:
                broken.append(f"{line['task_id']}: its reference solution fails: {line['detail']}")
            if args.unpatched and line["passed"]:
                broken.append(f"{line['task_id']}: the empty patch passes its tests")
    if args.canonical or args.unpatched:
        summary["broken"] = len(broken)
    for why in broken:
        print(f"error: {why}", file=sys.stderr)
    print(json.dumps(summary) if args.json else _summary_text(summary), flush=True)
    return 1 if summary["errors"] or errors or broken else 0


def _build_repo_tasks(args: argparse.Namespace) -> int:
    from rlstream.envs.repo_build import build
    from rlstream.schemas.errors import SetupError

    def log(msg: str) -> None:
        print(json.dumps({"progress": msg}) if args.json else msg, flush=True)

    packages = [p.strip() for p in args.packages.split(",") if p.strip()]
    try:
        out = build(packages, args.count, args.seed, log)
    except (SetupError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as fh:
        for row in out["rows"]:
            fh.write(json.dumps(row) + "\n")
    summary = out["summary"]
    print(json.dumps(summary) if args.json else f"{summary} -> {args.out}", flush=True)
    return 0 if summary["tasks"] >= args.count else 1


def _print_line(line: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(line), flush=True)
        return
    mark = "ERROR" if line["error"] else ("PASS " if line["passed"] else "FAIL ")
    print(f"{mark} {line['task_id']}  [{line['isolation']}]  {line['detail']}", flush=True)


def _summary_text(summary: dict[str, int]) -> str:
    text = f"{summary['tasks']} tasks, {summary['passed']} passed, {summary['errors']} errors"
    return text + (f", {summary['broken']} broken" if "broken" in summary else "")


def _isolation(args: argparse.Namespace) -> int:
    from rlstream.envs import sandbox

    found = sandbox.probe()
    if args.json:
        print(json.dumps({m: {"works": not why, "why_not": why} for m, why in found.items()}))
    else:
        for mode in sandbox.MODES:
            print(f"{mode:8} {'works' if not found[mode] else 'unavailable: ' + found[mode]}")
    return 0 if not found["full"] else 1


def _families(args: argparse.Namespace) -> int:
    from rlstream.envs.family import ENTRY_POINT_GROUP, plugins

    found = plugins()
    if args.json:
        print(json.dumps(found))
    else:
        print(f"task-family plugins (entry-point group {ENTRY_POINT_GROUP}):")
        for name, target in sorted(found.items()):
            print(f"  {name:10} {target}")
    return 0
