"""The pyfuncs set (``builtin:pyfuncs.jsonl``): held out by template, every reference passes its
own test and doctests, no test passes ``return None``, and the generator rewrites it exactly."""

from __future__ import annotations

import ast
import doctest
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from rlstream.envs import dataset
from rlstream.envs.dataset import DatasetConfig, DatasetFamily, Problem, answer_of

PATH = "builtin:pyfuncs.jsonl"
GENERATOR = "rlstream.envs.pyfuncs_build"
BOX = "userns"  # the weakest mode these tests accept, as in test_dataset


@pytest.fixture(scope="module")
def problems() -> dict[str, Problem]:
    return dataset.load(PATH)


def template_of(task_id: str) -> str:
    """``pyfuncs/TEMPLATE/I`` -> ``TEMPLATE`` (the unit of the split)."""
    prefix, template, index = task_id.split("/")
    assert prefix == "pyfuncs" and template and index.isdigit(), task_id
    return template


def namespace(program: str) -> dict[str, Any]:
    ns: dict[str, Any] = {}
    exec(compile(program, "<problem>", "exec"), ns)
    return ns


def check_passes(problem: Problem, body: str) -> bool:
    """Run ``check(entry_point)`` of ``problem.test`` on ``prompt + body``, in process."""
    ns = namespace(problem.prompt + body)
    exec(compile(problem.test, "<test>", "exec"), ns)
    try:
        ns["check"](ns[problem.entry_point])
    except AssertionError:
        return False
    return True


def test_the_splits_are_large_and_share_no_template(problems: dict[str, Problem]) -> None:
    templates: dict[str, set[str]] = {"train": set(), "eval": set()}
    for problem in problems.values():
        assert problem.split in templates, problem.task_id  # every line says its split
        templates[problem.split].add(template_of(problem.task_id))
    family = DatasetFamily("pyfuncs", DatasetConfig(path=PATH))
    assert len(family.splits["train"]) >= 200 and len(family.splits["eval"]) >= 64
    assert {template_of(r) for r in family.splits["eval"]} == templates["eval"]
    assert not templates["train"] & templates["eval"]
    assert len(templates["train"]) + len(templates["eval"]) >= 60
    # the first held-out rows in file order cover every held-out template once
    first = family.eval_tasks(len(templates["eval"]))
    assert {template_of(t.spec["row"]) for t in first} == templates["eval"]


def test_ids_and_entry_points_are_unique_identifiers(problems: dict[str, Problem]) -> None:
    lines = dataset.resolve(PATH).read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(problems)  # every line loaded (the loader refuses a repeated id)
    entries = [p.entry_point for p in problems.values()]
    assert len(set(entries)) == len(entries)
    by_template: dict[str, int] = defaultdict(int)
    for problem in problems.values():
        assert problem.entry_point.isidentifier(), problem.task_id
        assert problem.prompt.startswith(f"def {problem.entry_point}("), problem.task_id
        assert problem.canonical_solution, problem.task_id
        by_template[template_of(problem.task_id)] += 1
    assert min(by_template.values()) >= 2  # instances of a template differ in name


def test_every_reference_passes_and_return_none_fails(problems: dict[str, Problem]) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for problem in problems.values():  # all of them: well under a second in process
        assert problem.canonical_solution is not None
        assert check_passes(problem, problem.canonical_solution), problem.task_id
        assert not check_passes(problem, "    return None\n"), problem.task_id
        asserts = [ln for ln in problem.test.splitlines() if ln.strip().startswith("assert ")]
        assert 4 <= len(asserts) <= 8, problem.task_id
        # the docstring examples (what the policy's @test tool runs) hold for the reference
        ns = namespace(problem.prompt + problem.canonical_solution)
        node = ast.parse(problem.prompt).body[0]
        assert isinstance(node, ast.FunctionDef), problem.task_id
        docstring = ast.get_docstring(node) or ""
        examples = doctest.DocTestParser().get_doctest(docstring, ns, problem.entry_point, None, 0)
        assert examples.examples, problem.task_id
        assert runner.run(examples, out=lambda _: None).failed == 0, problem.task_id


def test_the_family_sandbox_scores_references_and_refuses_wrong_answers(
    problems: dict[str, Problem],
) -> None:
    family = DatasetFamily("pyfuncs", DatasetConfig(path=PATH))
    # a dict with int keys, a tuple of lists, a list of tuples: values cross the sandbox's pipes
    for row in ("pyfuncs/group_length/0", "pyfuncs/split_at/0", "pyfuncs/run_length/4"):
        problem = problems[row]
        assert problem.canonical_solution is not None
        answer = answer_of(problem.canonical_solution)
        verdict = family.score_problem(problem, answer, BOX)
        assert verdict.passed and verdict.error is None, (row, verdict.rationale)
        program = dataset.program_of(problem, answer)  # the @test tool: the doctest examples
        _, line = dataset.run_driver(problem, program, "visible", family.sandbox_config(BOX))
        assert line == "pass", row
        wrong = family.score_problem(problem, answer_of("return None"), BOX)
        assert not wrong.passed and wrong.error is None, row


def test_the_generator_rewrites_the_file_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "pyfuncs.jsonl"
    subprocess.run([sys.executable, "-m", GENERATOR, str(out)], check=True, capture_output=True)
    assert out.read_bytes() == dataset.resolve(PATH).read_bytes()
    assert out.stat().st_size < 1_500_000
