"""The repo task builder's pure rules (``envs.repo_build``): a tree keeps what the tests import
(src layouts, helpers and conftests beside the tests) and fits the policy's workspace; a
package that yields nothing is left out with a specific reason; the verdict side holds every
file of the tests itself. Nothing here downloads a package."""

from __future__ import annotations

import pytest

from rlstream.envs import repo, repo_build, repo_tools


def _tree(n_modules: int) -> dict[str, str]:
    """A src-layout package of ``n_modules`` modules, each with its own test module, a tests
    package with a helper and a conftest, and a module no test imports."""
    files = {
        "src/pkg/__init__.py": "from .core import base\n",
        "src/pkg/core.py": "def base():\n    return 1\n",
        "src/pkg/unused.py": "X = 1\n",
        "tests/__init__.py": "",
        "tests/conftest.py": "",
        "tests/helpers.py": "from pkg import core\n",
    }
    for i in range(n_modules):
        files[f"src/pkg/m{i}.py"] = "from . import core\n" + "x = 1\n" * 10 * (i + 1)
        files[f"tests/test_m{i}.py"] = f"from pkg import m{i}\nfrom .helpers import core\n"
    return files


def test_the_paths_follow_the_layout_and_never_name_a_test_folder() -> None:
    assert repo_build.source_paths(_tree(1)) == ["src"]
    assert repo_build.source_paths(["pkg/a.py", "test/test_a.py", "x.py"]) == ["."]
    local, modules = repo.verdict_side(_tree(1), ["src"], ["tests/test_m0.py::t"])
    assert "tests/helpers.py" in local and modules == ["pkg"]  # the helper is the tests' own


def test_a_test_module_needs_its_imports_helpers_conftests_and_packages_above() -> None:
    files = _tree(3)
    got = repo_build.needs(files, ["tests/test_m1.py"], ["src"])
    assert got == {
        "tests/test_m1.py", "tests/__init__.py", "tests/conftest.py", "tests/helpers.py",
        "src/pkg/__init__.py", "src/pkg/m1.py", "src/pkg/core.py",
    }  # fmt: skip


def test_a_tree_that_fits_is_kept_whole_less_docs_and_examples_no_test_imports() -> None:
    files = _tree(3)
    extra = {"docs/conf2.py": "", "examples/a.py": "", "examples/b.py": "",
             "tests/test_ex.py": "from examples import a\n"}  # fmt: skip
    kept = repo_build.select({**files, **extra}, ["src"])
    assert kept == {*files, "tests/test_ex.py", "examples/a.py"}


def test_a_larger_tree_keeps_the_smallest_test_modules_that_fit(monkeypatch) -> None:
    files = _tree(40)  # 86 files: over the workspace's cap
    monkeypatch.setattr(repo_build, "MAX_FILES", 20)
    kept = repo_build.select(files, ["src"])
    tests = sorted(p for p in kept if repo_build.is_test_module(p))
    assert len(kept) <= 20 and "src/pkg/unused.py" not in kept
    assert tests == [f"tests/test_m{i}.py" for i in range(len(tests))]  # the smallest first
    for t in tests:  # every kept test module has all it needs
        assert repo_build.needs(files, [t], ["src"]) <= kept


def test_the_budget_is_the_workspace_cap_with_room_to_spare() -> None:
    assert repo_build.MAX_FILES < repo_tools.MAX_FILES
    assert repo_build.MAX_BYTES < repo_tools.MAX_BYTES


def test_a_tree_that_cannot_fit_or_has_no_tests_says_so(monkeypatch) -> None:
    with pytest.raises(ValueError, match="no tests found"):
        repo_build.select({"pkg/__init__.py": ""}, ["."])
    monkeypatch.setattr(repo_build, "MAX_FILES", 3)
    with pytest.raises(ValueError, match=r"86 files .* needs 7 files .* at most 3 files"):
        repo_build.select(_tree(40), ["src"])


@pytest.mark.parametrize(
    ("outcomes", "messages", "why"),
    [
        ({}, {"error": "timeout: wall"}, "the test run failed: timeout: wall"),
        ({}, {}, "pytest collected no tests"),
        (
            {"tests/test_a.py": "error", "tests/test_b.py": "error"},
            {"tests/test_a.py": ["E   ModuleNotFoundError: No module named 'hypothesis'"],
             "tests/test_b.py": ["E   ModuleNotFoundError: No module named 'freezegun.api'"]},
            "tests need packages freezegun, hypothesis not installed in the sandbox",
        ),
        (
            {"tests/test_a.py": "error"},
            {"tests/test_a.py": ["E   ImportError: cannot import name 'x' from 'tests'"]},
            "test collection failed: tests/test_a.py: ImportError: cannot import name 'x' from "
            "'tests'",
        ),
        (
            {"t.py::a": "failed", "t.py::b": "skipped"},
            {"t.py::a": ["E   assert 1 == 2"]},
            "no test passes: t.py::a failed: assert 1 == 2",
        ),
        (
            {"t.py::a": "error", "tests/test_a.py": "error"},
            {"t.py::a": ["E   AssertionError: C extension not loaded"],
             "tests/test_a.py": ["E   FileNotFoundError: bin/x.py"]},
            "no test passes: t.py::a error: AssertionError: C extension not loaded; "
            "test collection failed: tests/test_a.py: FileNotFoundError: bin/x.py",
        ),
    ],
)  # fmt: skip
def test_a_suite_with_no_passing_test_says_why(outcomes, messages, why) -> None:
    files = ["src/pkg/__init__.py", "tests/test_a.py"]
    assert repo_build.diagnose(outcomes, messages, files) == why


def test_a_module_of_the_tree_missing_is_not_a_package_to_install() -> None:
    said = {"tests/test_a.py": ["E   ModuleNotFoundError: No module named 'tests.helpers'"]}
    why = repo_build.diagnose({"tests/test_a.py": "error"}, said, ["tests/test_a.py"])
    assert why.startswith("test collection failed: tests/test_a.py")


def test_the_verdict_side_holds_every_file_of_the_tests() -> None:
    files = _tree(2)  # tests/ is a package: `from .helpers import` finds the helper there
    local, modules = repo.verdict_side(files, ["src"], ["tests/test_m0.py::test_x"])
    assert set(local) == {p for p in files if p.startswith("tests/")} and modules == ["pkg"]
    # a tree built before (tests on its paths): `import helpers` stays the package's, as it was
    _, modules = repo.verdict_side(files, ["src", "tests"], ["tests/test_m0.py::test_x"])
    assert {"helpers", "pkg"} <= set(modules) and "tests" not in modules
    flat = {"pkg/__init__.py": "", "test/helpers.py": "", "test/test_a.py": ""}
    local, modules = repo.verdict_side(flat, ["."], ["test/test_a.py::t"])
    assert set(local) == {"test/helpers.py", "test/test_a.py"} and modules == ["pkg"]


def test_the_next_site_is_of_the_package_with_the_fewest_tasks_that_has_sites_left() -> None:
    assert repo_build.next_package([3, 1, 1], [5, 5, 5]) == 1  # the first on a tie
    assert repo_build.next_package([3, 1, 0], [5, 5, 0]) == 1  # the third has no site left
    assert repo_build.next_package([0, 0], [1, 1]) == 0
