"""The self-check of a run's tasks before it trains on them (``rlstream launch``).

A task whose own reference answer fails (tests that do not import, a syntax error, a wrong entry
point, a reference patch that does not apply) gives every sample 0 in training: nothing learns
from it and nothing says so. ``check_tasks`` scores each family's reference answers
(``TaskFamily.references``) with the ``tests`` judge the run uses, in the run's isolation, and
names every task whose reference fails; a family with no reference answers (``fx``, a dataset
file without ``canonical_solution``s) is counted as unchecked.

A passed check is remembered by what it checked (the families' specs and the bytes of every file they
name) under ``~/.cache/rlstream/task-checks/``, so launching the same tasks again costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlstream.ops.run.config import RunConfig

CACHE_ENV = "RLSTREAM_CACHE"


@dataclass
class TaskCheck:
    """What a self-check found: tasks checked, broken (``task_id: why``), unchecked by family."""

    checked: int = 0
    broken: list[str] = field(default_factory=list)
    unchecked: dict[str, str] = field(default_factory=dict)
    cached: bool = False


def _cache_file(specs: dict[str, Any], isolation: str) -> Path:
    from rlstream.envs.dataset import resolve

    digest = hashlib.sha256(json.dumps([specs, isolation], sort_keys=True).encode())
    for spec in specs.values():
        path = (spec.get("options") or {}).get("path")
        if isinstance(path, str):
            try:
                digest.update(resolve(path).read_bytes())
            except OSError:
                digest.update(b"unreadable")
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rlstream")
    return root / "task-checks" / f"{digest.hexdigest()[:24]}.json"


def check_tasks(config: RunConfig, log: Callable[[str], None] = print, jobs: int = 2) -> TaskCheck:
    """Score every family's reference answers (see the module docstring)."""
    from rlstream.envs import family as task_families
    from rlstream.envs.judges import JudgeConfig, judge_tests

    specs = {k: v.model_dump(mode="json") for k, v in config.run_families().items()}
    cache = _cache_file(specs, config.isolation)
    if cache.exists():
        return TaskCheck(**{**json.loads(cache.read_text()), "cached": True})
    families = task_families.families(config.run_families())
    judge = JudgeConfig(
        kind="tests", families=config.run_families(), isolation=config.isolation, evaluation=True
    )
    result = TaskCheck()
    todo: list[tuple[str, str]] = []
    for name, fam in families.items():
        refs = fam.references()
        if not refs:
            result.unchecked[name] = "no reference answers"
        todo += list(refs.items())
    if todo:
        log(f"checking {len(todo)} tasks' reference answers in the sandbox ...")
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        verdicts = pool.map(
            lambda t: judge_tests({"task_id": t[0], "completion": t[1]}, judge), todo
        )
        for n, ((task_id, _), reward) in enumerate(zip(todo, verdicts, strict=True), 1):
            result.checked += 1
            if not reward["passed"]:
                why = reward.get("error") or reward["rationale"]
                result.broken.append(f"{task_id}: its reference fails: {why[:300]}")
            if n % 50 == 0:
                log(f"  {n}/{len(todo)} checked, {len(result.broken)} broken")
    if not result.broken:  # a failure may be the machine's (no sandbox): checked again next time
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({k: v for k, v in asdict(result).items() if k != "cached"}))
    return result
