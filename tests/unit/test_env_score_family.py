"""``rlstream env score --family``: answers scored by any family, plugins included, by the same
``tests`` judge the pipeline runs; a family that cannot be had is one line and exit status 2."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest

from rlstream.ops.cli import main

RIGHT, WRONG = "x=x*x;x=abs(x);return x", "x=x+x;return x"  # task fx-5: square, abs


def _score(tmp_path: Path, *args: str, answers: list[dict]) -> subprocess.CompletedProcess[str]:
    """``rlstream env score --answers FILE --json ARGS`` in this process."""
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(a) + "\n" for a in answers))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["env", "score", "--answers", str(path), "--json", *args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize(
    "how",
    [
        ["--family", "fx"],  # the installed plugin
        ["--family", "fx", "--recipe", "demo"],  # the recipe's family of that name
    ],
    ids=["plugin", "recipe"],
)
def test_answers_are_scored_by_the_named_family(tmp_path: Path, how: list[str]) -> None:
    answers = [
        {"task_id": "fx-5", "completion": RIGHT},
        {"task_id": "fx-5", "completion": WRONG},
        {"task_id": "other-1", "completion": RIGHT},
    ]
    out = _score(tmp_path, *how, answers=answers)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line.get("passed") for line in lines[:3]] == [True, False, False]
    assert lines[0]["isolation"] == "full" and "all hidden tests pass" in lines[0]["detail"]
    assert lines[2]["error"] and "not in this run" in lines[2]["detail"]
    assert lines[3] == {"tasks": 3, "passed": 1, "errors": 1}
    assert out.returncode == 1  # an answer of no family of this run is an error line


def test_a_plugin_wrapping_another_scores_as_its_inner_family(tmp_path: Path) -> None:
    """The harness's ``slow`` plugin (``ops.bench.slow_env``) wraps fx; its tasks are slow-N."""
    answers = [{"task_id": "fx-5", "completion": RIGHT}]
    out = _score(tmp_path, "--family", "slow", "--options", '{"median_s": 0.1}', answers=answers)
    assert out.returncode == 1  # the family is named `slow`: fx-5 is not one of its tasks
    answers = [{"task_id": "slow-5", "completion": RIGHT}]
    out = _score(tmp_path, "--family", "slow", "--options", '{"median_s": 0.1}', answers=answers)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout.splitlines()[0])["passed"]


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--family", "nosuch"], "no task-family plugin 'nosuch'"),
        (["--family", "mine", "--recipe", "demo"], "the recipe has no family 'mine'"),
        (["--family", "fx", "--options", "{bad"], "--options is not JSON"),
        (["--family", "fx", "--options", '{"zzz": 1}'], "zzz"),
    ],
)
def test_a_family_that_cannot_be_had_is_one_line(tmp_path: Path, args: list[str], why: str):
    out = _score(tmp_path, *args, answers=[{"task_id": "fx-5", "completion": RIGHT}])
    assert out.returncode == 2 and why in out.stderr and "Traceback" not in out.stderr
