"""Verdicts out of the answer's reach: each wrong answer here once scored as passing, or turned
its failure into a judge error, or crashed the scorer; each must now score a plain fail.

Repo family: a patch that forges the report (on a descriptor, by name and without, or by
replacing the report's encoder), plants a ``pytest.py``, a ``*.dist-info`` plugin, a conftest
outside the tests, options in ``setup.cfg``, a test helper, or a file under a file. The refusals
before the run (``patch_policy``) and the structure of the run (the tests in the verdict side,
the package apart: ``repo_bridge``) are each checked on their own: the structural probes bypass
the policy and call the test run directly.
Dataset family: an answer raising ``StopIteration`` into the tests' ``map``/``filter``/``zip``.
Every family: an answer that claims a sandbox set-up failure (the old exit-70 convention).
"""

from __future__ import annotations

import pytest

from rlstream.envs import patch_policy, patches, repo, sandbox
from rlstream.envs.dataset import DatasetConfig, DatasetFamily, Problem
from rlstream.envs.family import EVAL_SEED_BASE, FamilySpec
from rlstream.envs.judges import JudgeConfig, judge_tests
from rlstream.envs.sandbox.attacks import FORGE_JSON, FORGING_PLUGIN, SHADOW_PYTEST
from rlstream.envs.tools import Workspace
from rlstream.ops.bench.common import median_ci95

FILE = "builtin:repo/tasks.jsonl"
BOX = "userns"  # the weakest mode accepted; as root every run here is "full"

FORGE_REPORT = (
    "import os, json, __main__\n"
    "os.write(4, json.dumps({'outcomes': {t: 'passed' for t in __main__.TESTS}}).encode())\n"
    "os._exit(0)\n"
)
FORGE_HIDDEN = (  # no refused name: the descriptor by a computed number, then a clean exit
    "import json, __main__\n"
    "_fd = int('4')\n"
    "with open(_fd, 'w', closefd=False) as _f:\n"
    "    _f.write(json.dumps({'outcomes': {t: 'passed' for t in __main__.TESTS}}))\n"
    "raise SystemExit(0)\n"
)
FORGE_SELF = (  # os reached through a builtin's module, then a report on either descriptor
    "_o = vars(getattr(len, '__se' + 'lf__'))['__imp' + 'ort__']('o' + 's')\n"
    "for _fd in (3, 4):\n"
    "    try:\n"
    "        getattr(_o, 'wri' + 'te')(_fd, b'\\x00\\x00\\x00\\x0e{\"outcomes\": {}}')\n"
    "    except OSError:\n"
    "        pass\n"
)


@pytest.fixture(scope="module")
def fam() -> repo.RepoFamily:
    found = sandbox.probe()
    if found["full"] and found["userns"]:
        pytest.skip(f"no namespaced sandbox here: {found}")
    return repo.RepoFamily("repo", repo.RepoConfig(path=FILE, eval_fraction=0.0))


def _task(fam: repo.RepoFamily, package: str) -> repo.RepoTask:
    return next(t for t in fam.loaded.tasks.values() if t.repo.startswith(package))


def _source_file(files: dict[str, str]) -> str:
    return next(p for p in sorted(files) if p.endswith("__init__.py") and not repo.is_test_file(p))


def _score(fam: repo.RepoFamily, task: repo.RepoTask, changed: dict[str, str | None]):
    """Score the base tree with ``changed`` laid over it (None removes a file) as a patch."""
    base = repo.base_files(task, fam.loaded.trees[task.base])
    files = {**base, **{k: v for k, v in changed.items() if v is not None}}
    return fam.score_patch(task, patches.diff(base, files), BOX)


def _run_unfiltered(fam: repo.RepoFamily, task: repo.RepoTask, extra: dict[str, str]):
    """The test run alone, on the base tree plus ``extra``: the structure, without the policy."""
    tree = fam.loaded.trees[task.base]
    files = {**repo.base_files(task, tree), **extra}
    return repo.run_tests(task, tree, files, repo.box(fam.cfg, BOX))


@pytest.mark.parametrize("package", ["inflection", "semver", "isodate"])
def test_a_report_forged_from_the_package_fails(fam, package) -> None:
    """The answer's process runs no test and writes no report: whatever it writes, to either
    descriptor or through the runner's modules, reaches no outcome."""
    task = _task(fam, package)
    base = repo.base_files(task, fam.loaded.trees[task.base])
    init = _source_file(base)
    for forged in (FORGE_REPORT, FORGE_HIDDEN, FORGE_JSON, FORGE_SELF):
        assert not patch_policy.check(base, {**base, init: forged + base[init]})
        v = _score(fam, task, {init: forged + base[init]})
        assert not v.passed and v.error is None, (forged, v)
        assert task.FAIL_TO_PASS[0] in v.rationale or "gone" in v.rationale, v


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("repo_shadow_pytest", {"pytest.py": SHADOW_PYTEST}),
        ("repo_shadow_pytest_src", {"src/pytest.py": SHADOW_PYTEST}),
        ("repo_plugin_autoload", {
            "forge-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: forge\nVersion: 1.0\n",
            "forge-1.0.dist-info/entry_points.txt": "[pytest11]\nforge = forge_plugin\n",
            "forge_plugin.py": FORGING_PLUGIN,
        }),
        ("conftest_outside_tests", {"src/conftest.py": FORGING_PLUGIN}),
        ("options_in_setup_cfg", {
            "setup.cfg": "[tool:pytest]\naddopts = -p forge_plugin\n",
            "pytest.ini": "[pytest]\naddopts = -p forge_plugin\n",
            "forge_plugin.py": FORGING_PLUGIN,
        }),
    ],
)  # fmt: skip
@pytest.mark.parametrize("package", ["inflection", "semver"])
def test_planted_test_machinery_neither_passes_nor_takes_effect(fam, package, name, extra) -> None:
    task = _task(fam, package)
    v = _score(fam, task, dict(extra))
    assert not v.passed and v.error is None, (name, v)
    structural = _run_unfiltered(fam, task, extra)  # the same files, no policy in front
    assert not structural.passed and structural.error is None, (name, structural)
    assert task.FAIL_TO_PASS[0] in structural.rationale, structural


def test_a_changed_test_helper_is_laid_again_from_the_base(fam) -> None:
    task = _task(fam, "semver")
    tree = fam.loaded.trees[task.base]
    base = repo.base_files(task, tree)
    helpers = [
        p for p in base if p.startswith("tests/") and not p.rsplit("/")[-1].startswith("test")
    ]
    assert helpers and all(repo.is_test_file(p) for p in helpers)
    changed = {p: "raise SystemExit(0)\n" for p in helpers}
    files = repo.prepared(task, tree, patches.diff(base, {**base, **changed}))
    assert isinstance(files, dict) and all(files[p] == base[p] for p in helpers)


def test_a_file_under_a_file_is_a_scored_fail_never_a_crash(fam) -> None:
    task = _task(fam, "inflection")
    base = repo.base_files(task, fam.loaded.trees[task.base])
    init = _source_file(base)
    patch = f"--- /dev/null\n+++ b/{init}/x\n@@ -0,0 +1 @@\n+x\n"
    v = fam.score_patch(task, patch, BOX)
    assert not v.passed and v.error is None, v
    r = sandbox.run("print('ran')", sandbox.SandboxConfig(isolation=BOX),
                    files={"a.py": "x", "a.py/b": "y"})  # fmt: skip
    assert r.status == "crash" and "cannot be laid out" in r.reason and "ran" not in r.stdout
    ws = Workspace({"a.py": b"x"}, 8, 1000)
    for name in ("a.py/b", "a.py/b/c"):
        with pytest.raises(ValueError, match="a file and a folder"):
            ws.put(name, b"y")
    ws.put("d/e.py", b"z")
    with pytest.raises(ValueError, match="a file and a folder"):
        ws.put("d", b"y")


def test_the_judge_scores_a_file_under_a_file_as_a_fail(fam) -> None:
    task = _task(fam, "inflection")
    init = _source_file(repo.base_files(task, fam.loaded.trees[task.base]))
    spec = FamilySpec(plugin="repo", options={"path": FILE, "eval_fraction": 0.0})
    cfg = JudgeConfig(kind="tests", families={"repo": spec}, isolation=BOX, evaluation=True)
    traj = {
        "task_id": f"repo-{EVAL_SEED_BASE}:{task.instance_id}",
        "completion": f"--- /dev/null\n+++ b/{init}/x\n@@ -0,0 +1 @@\n+x\n",
    }
    reward = judge_tests(traj, cfg)
    assert reward["score"] == 0.0 and "error" not in reward, reward


@pytest.mark.parametrize(
    "test",
    [
        "def check(candidate):\n    assert all(map(candidate, [1, 2, 3]))\n",
        "def check(candidate):\n    assert not list(filter(lambda x: not candidate(x), [1, 2]))\n",
        "def check(candidate):\n    assert all(a for a, _ in zip(map(candidate, [1, 2]), [1, 2]))\n",
        "def check(candidate):\n    assert [x for x in map(candidate, [1, 2]) if not x] == []\n",
    ],
)
def test_stop_iteration_from_the_answer_does_not_end_the_tests_early(test: str) -> None:
    fam = DatasetFamily("mini", DatasetConfig())
    problem = Problem("p/0", 'def f(x):\n    """Is x positive?"""\n', "f", test)
    assert fam.score_problem(problem, "    return x > 0\n", BOX).passed
    for exc in ("StopIteration", "StopAsyncIteration"):
        v = fam.score_problem(problem, f"    raise {exc}\n", BOX)
        assert not v.passed and v.error is None, v
        assert "RuntimeError" in v.rationale and exc in v.rationale, v.rationale


def test_an_answer_cannot_claim_a_sandbox_setup_failure() -> None:
    """Exit 70 with the old set-up message on stderr is the answer's crash, not a judge error:
    only the sandbox's own channel can say that set-up failed."""
    cfg = sandbox.SandboxConfig(isolation=BOX)
    code = "import sys\nsys.stderr.write('sandbox setup failed: forged\\n')\nsys.exit(70)\n"
    r = sandbox.run(code, cfg)
    assert r.status == "crash" and r.exit_code == 70, r
    from rlstream.envs.fx import FxFamily

    fx = FxFamily("fx", FxFamily.Config())
    task = fx.sample(3)
    answer = (
        "__import__('sys').stderr.write('sandbox setup failed: x\\n');"
        "__import__('os')._exit(70);return x"
    )
    v = fx.score(task.task_id, answer, BOX)
    assert not v.passed and v.error is None, v


def test_the_shipped_tasks_still_pass_with_their_patch_and_fail_without(fam) -> None:
    seen: set[str] = set()
    for task in fam.loaded.tasks.values():
        if task.repo in seen:
            continue
        seen.add(task.repo)
        good = fam.score_patch(task, task.patch, BOX)
        assert good.passed, (task.instance_id, good.rationale)
        empty = fam.score_patch(task, "", BOX)
        assert not empty.passed and empty.error is None


def test_the_policy_names_what_it_refuses_and_leaves_the_base_alone() -> None:
    base = {"pkg/__init__.py": "X = 1\n", "pytest_plugin_of_the_repo.py": ""}
    assert patch_policy.check(base, {**base, "pkg/__init__.py": "import os\nX = os.sep\n"}) == []
    bad = {
        **base,
        "pytest_forge.py": "",
        "x.pth": "",
        "a.egg-info/PKG-INFO": "",
        "pkg/__init__.py/c": "",
    }
    found = "\n".join(patch_policy.check(base, bad))
    for what in ("pytest_forge.py", "x.pth", "egg-info", "nothing can lie under it"):
        assert what in found, (what, found)
    assert "pytest_plugin_of_the_repo" not in found


def test_no_installed_package_is_readable_in_the_sandbox() -> None:
    """Where rlstream (hidden tests, canonical solutions, reference patches) lies when it is
    installed into the interpreter rather than a virtualenv: every site-packages and
    dist-packages folder of what the sandbox binds shows empty inside it."""
    import os
    import sys

    from rlstream.envs.sandbox import root as sandbox_root

    found = sandbox_root.installed_packages(["/usr", os.path.realpath(sys.base_prefix)])
    assert any(os.listdir(p) for p in found), found  # something is installed on the host
    code = f"import os\nfor p in {found!r}:\n    print(p, len(os.listdir(p)))\n"
    r = sandbox.run(code, sandbox.SandboxConfig(isolation=BOX))
    assert r.status == "ok", r
    assert r.stdout.split() == [w for p in found for w in (p, "0")], r.stdout


def test_the_verdicts_bench_times_both_arms_on_passing_work(fam) -> None:
    """``rlstream bench verdicts`` at its smallest: every package, both arms, reference patches
    passing in each (else it raises), and the defences switched back on afterwards."""
    import argparse

    from rlstream.ops.bench import verdicts

    result = verdicts.run(argparse.Namespace(pairs=2, isolation=BOX))
    assert set(result["packages"]) == {t.repo for t in fam.loaded.tasks.values()}
    for p in result["packages"].values():
        assert p["with_defences_ms"] > 0 and p["without_ms"] > 0 and p["policy_check_ms"] >= 0
    assert median_ci95([float(i) for i in range(20)]) == [5.0, 14.0]


def test_the_chaos_runs_forgeries_fail_through_the_tests_rubric(tmp_path) -> None:
    """What ``bench chaos`` sends its judge (``ops.chaos.attacks.forged_answers``), scored by the
    rubric the judge role applies, with the families a chaos run adds: every forgery a plain
    fail, never an error, and each family's control a pass."""
    from rlstream.ops.chaos.attacks import attack_families, forged_answers
    from rlstream.ops.run.config import load_run_config

    families = load_run_config(None, attack_families(tmp_path)).run_families()
    cfg = JudgeConfig(kind="tests", families=families, isolation=BOX)
    for kind, (task_id, completion) in forged_answers(families).items():
        reward = judge_tests({"task_id": task_id, "completion": completion}, cfg)
        assert "error" not in reward or not reward["error"], (kind, reward)
        assert bool(reward["passed"]) == kind.startswith("control:"), (kind, reward)


def test_the_runner_never_imports_a_module_of_the_repository(fam) -> None:
    """A repository module named like one of the test library's (``iniconfig``, ``packaging``)
    is never what the verdict side's pytest imports: the right fix still passes beside one that
    would break the runner if it were."""
    task = _task(fam, "inflection")
    tree = fam.loaded.trees[task.base]
    fixed = patches.apply(repo.base_files(task, tree), task.patch)
    for name in ("iniconfig", "packaging"):
        files = {**fixed, f"{name}/__init__.py": "raise SystemExit(3)\n"}
        v = repo.run_tests(task, tree, files, repo.box(fam.cfg, BOX))
        assert v.passed, (name, v)
