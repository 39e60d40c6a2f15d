"""The run's self-check before it trains: every task whose own reference fails is named, a
family without references is counted unchecked, and a passed check is not run twice."""

from __future__ import annotations

import json
from pathlib import Path

from rlstream.ops.run.config import load_run_config
from rlstream.ops.run.task_check import CACHE_ENV, check_tasks


def _problem(i: int, canonical: str | None, test: str = "") -> dict:
    row = {
        "task_id": f"p{i}",
        "prompt": f'def f{i}(x):\n    """Return x plus {i}."""\n',
        "entry_point": f"f{i}",
        "test": test or f"def check(candidate):\n    assert candidate(1) == {1 + i}\n",
    }
    if canonical is not None:
        row["canonical_solution"] = canonical
    return row


def _config(tmp_path: Path, rows: list[dict]):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = json.dumps({"path": str(path), "wall_timeout_s": 5.0})
    return load_run_config(
        None, [f'families={{"mine": {{"plugin": "dataset", "options": {options}}}}}']
    )


def test_broken_tasks_are_named_and_good_ones_pass(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    rows = [
        _problem(1, "    return x + 1\n"),
        _problem(2, "    return x + 3\n"),  # a wrong reference
        _problem(3, "    return x + 3\n", "import no_such_module\ndef check(c):\n    pass\n"),
        _problem(4, "    return (x +\n"),  # a syntax error
        _problem(5, None),  # no reference: unchecked, not broken
    ]
    found = check_tasks(_config(tmp_path, rows), log=lambda _: None)
    assert found.checked == 4 and not found.cached
    broken = sorted(line.split(":")[1] for line in found.broken)
    assert broken == ["p2", "p3", "p4"], found.broken
    assert not list((tmp_path / "cache").glob("task-checks/*.json"))  # a failed check is not kept


def test_a_passed_check_is_remembered_by_what_it_checked(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    config = _config(tmp_path, [_problem(1, "    return x + 1\n")])
    first = check_tasks(config, log=lambda _: None)
    assert (first.checked, first.broken, first.cached) == (1, [], False)
    assert check_tasks(config, log=lambda _: None).cached
    (tmp_path / "b").mkdir()  # a new file (this process keeps families by their options)
    changed = _config(tmp_path / "b", [_problem(1, "    return x + 2\n")])
    again = check_tasks(changed, log=lambda _: None)
    assert not again.cached and len(again.broken) == 1


def test_a_family_without_references_is_unchecked(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    found = check_tasks(load_run_config(None, []), log=lambda _: None)
    assert found.checked == 0 and found.unchecked == {"fx": "no reference answers"}
