"""Dataset tasks that declare packages: the answer and the tests import them from a read-only
library the sandbox binds (only the standard library otherwise), which no answer can change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlstream.envs import family as task_families
from rlstream.envs import sandbox

PROBLEM = {
    "task_id": "v/0",
    "prompt": 'def norm(s):\n    """The version string s, normalised."""\n',
    "entry_point": "norm",
    "test": "from packaging.version import Version\n"
    "def check(candidate):\n    assert Version(candidate('1.0')) == Version('1.0.0')\n",
    "canonical_solution": "    from packaging.version import Version\n    return str(Version(s))\n",
}


def _family(tmp_path: Path, packages: list[str]):
    path = tmp_path / f"tasks-{len(packages)}.jsonl"
    path.write_text(json.dumps(PROBLEM) + "\n")
    spec = task_families.FamilySpec(
        plugin="dataset", options={"path": str(path), "packages": packages, "eval_fraction": 0}
    )
    return task_families.families({"v": spec})["v"]


def _score(fam, body: str):
    return fam.score("v-1000000000000:v/0", f"```python\n{PROBLEM['prompt']}{body}```")


def test_declared_packages_are_importable_by_answer_and_tests(tmp_path: Path) -> None:
    bare, with_packaging = _family(tmp_path, []), _family(tmp_path, ["packaging"])
    assert "No module named 'packaging'" in _score(bare, PROBLEM["canonical_solution"]).rationale
    verdict = _score(with_packaging, PROBLEM["canonical_solution"])
    assert verdict.passed and verdict.isolation == "full", verdict


def test_no_answer_can_change_the_library(tmp_path: Path) -> None:
    fam = _family(tmp_path, ["packaging"])
    lib = Path(sandbox.library_of(("packaging",))) / "packaging" / "version.py"
    body = (
        f"    open({str(lib)!r}, 'a').write('\\nVersion = str\\n')\n"
        "    from packaging.version import Version\n    return str(Version(s))\n"
    )
    assert not _score(fam, body).passed
    assert "Version = str" not in lib.read_text()
    assert _score(fam, PROBLEM["canonical_solution"]).passed


def test_a_package_that_is_not_installed_is_refused_with_the_recipe(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="packages: not importable here: no_such_pkg_x"):
        _family(tmp_path, ["no_such_pkg_x"])
