"""The ``repo`` task family (``envs.repo``, ``envs.repo_tools``, ``envs.patches``): the shipped
tasks, built from real packages' sdists, score 1 with their reference patch and 0 without, in
the sandbox; the editing tools act on the workspace and the answer is its diff; a patch that
does not apply, reaches outside the repository, or runs out of time scores 0 with the reason in
the reward's details; an answer cannot pass by editing the tests; a broken task row is reported
as FILE:LINE and the rest still load."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rlstream.envs import patches, repo, repo_tools, sandbox
from rlstream.envs.family import EVAL_SEED_BASE, FamilySpec
from rlstream.envs.judges import JudgeConfig, judge_tests

FILE = "builtin:repo/tasks.jsonl"


@pytest.fixture(scope="module")
def fam() -> repo.RepoFamily:
    return repo.RepoFamily("repo", repo.RepoConfig(path=FILE, eval_fraction=0.0))


def _one_per_package(fam: repo.RepoFamily) -> list[repo.RepoTask]:
    firsts: dict[str, repo.RepoTask] = {}
    for task in fam.loaded.tasks.values():
        firsts.setdefault(task.repo, task)
    return list(firsts.values())


def _cfg(**options) -> JudgeConfig:
    spec = FamilySpec(plugin="repo", options={"path": FILE, "eval_fraction": 0.0, **options})
    return JudgeConfig(kind="tests", families={"repo": spec}, isolation="userns", evaluation=True)


def _judge(task: repo.RepoTask, patch: str, cfg: JudgeConfig | None = None) -> dict:
    traj = {"task_id": f"repo-{EVAL_SEED_BASE}:{task.instance_id}", "completion": patch}
    return judge_tests(traj, cfg or _cfg())


def test_the_shipped_set_spans_packages_and_records_its_sources(fam) -> None:
    tasks = list(fam.loaded.tasks.values())
    assert not fam.loaded.errors and len(tasks) >= 20
    assert len({t.source["package"] for t in tasks}) >= 3
    for t in tasks:
        assert t.seed is not None and t.source["version"] and len(t.source["sha256"]) == 64
        assert t.FAIL_TO_PASS and t.patch and t.base_patch
    assert Path(repo.resolve(FILE)).stat().st_size < 1_500_000


@pytest.mark.parametrize(("flag", "passed"), [("--canonical", True), ("--unpatched", False)])
def test_every_reference_patch_passes_and_every_unpatched_task_fails(
    fam, flag: str, passed: bool
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rlstream", "env", "score", "--tasks", FILE, flag, "--json",
         "--isolation", "userns"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    results, summary = lines[:-1], lines[-1]
    assert done.returncode == 0 and summary["errors"] == 0, done.stderr
    assert len(results) == len(fam.loaded.tasks) == summary["tasks"]
    bad = [r for r in results if r["passed"] is not passed]
    assert not bad, bad
    if not passed:  # the first test that must pass is named
        tasks = fam.loaded.tasks
        assert all(tasks[r["task_id"]].FAIL_TO_PASS[0] in r["detail"] for r in results)


def test_threads_scoring_at_once_share_one_test_library(monkeypatch) -> None:
    """A scorer's threads start at once: each asks for the test library for its sandbox's binds
    and again for its driver, and all must get one folder (two copies made at once once gave a
    thread a driver naming a folder its sandbox did not bind: no pytest, a reference patch
    scored 0)."""
    import functools
    import threading

    # a cache of its own, empty: the process's library (made by earlier tests) is left as it is
    fresh = functools.cache(sandbox._library_of.__wrapped__)
    monkeypatch.setattr(sandbox, "_library_of", fresh)
    start, seen = threading.Barrier(4), []

    def ask() -> None:
        start.wait()
        seen.append(repo_tools.test_library())
        seen.append(repo_tools.test_library())

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 8 and len(set(seen)) == 1, seen


def test_pure_rules_of_the_builder() -> None:
    from rlstream.envs import repo_build

    src = "def f(a, b):\n    if a < b and b != 2:\n        return a + 1\n    return True\n"
    found = repo_build.sites("m.py", src)
    assert [(s.old, s.new) for s in found] == [
        ("<", "<="), ("and", "or"), ("!=", "=="), ("2", "3"), ("+", "-"), ("1", "2"),
        ("True", "False"),
    ]  # fmt: skip
    assert repo_build.mutate(src, found[0]).splitlines()[1] == "    if a <= b and b != 2:"
    runs = [{"a.py::x", "b.py::t[1]", "b.py::t[2]"}, {"a.py::x", "b.py::t[1]", "b.py::t[3]"}]
    assert repo_build.stable(runs) == {"a.py::x"}  # b.py's ids move: all of it is left out


def test_a_patch_that_does_not_apply_or_leaves_the_repo_scores_zero_saying_why(fam) -> None:
    task = _one_per_package(fam)[0]
    broken = task.patch.replace("\n-", "\n-NOT THERE ", 1)
    r = _judge(task, broken)
    assert r["score"] == 0 and r["details"]["patch.does_not_apply"] == 1.0
    assert "does not apply" in r["rationale"] and "error" not in r
    outside = "--- a/../../etc/passwd\n+++ b/../../etc/passwd\n@@ -1 +1 @@\n-x\n+y\n"
    r = _judge(task, outside)
    assert r["score"] == 0 and r["details"]["patch.outside_repo"] == 1.0
    assert "outside the repository" in r["rationale"]


def test_a_patch_that_hangs_scores_zero_as_a_timeout(fam) -> None:
    task = _one_per_package(fam)[0]
    tree = fam.loaded.trees[task.base]
    files = repo.base_files(task, tree)
    path = next(p for p in sorted(files) if p.endswith(".py") and not repo.is_test_file(p))
    hang = dict(files)
    hang[path] = "while True:\n    pass\n" + files[path]
    # the CPU limit well above the wall timeout: a busy loop must meet the timeout first, not
    # race it to a CPU-limit kill (which scores 0 as a dead process, not as a timeout)
    r = _judge(task, patches.diff(files, hang), _cfg(wall_timeout_s=4, cpu_limit_s=30))
    assert r["score"] == 0 and r["details"].get("tests.timeout") == 1.0, r


def test_an_answer_cannot_pass_by_editing_the_tests(fam) -> None:
    task = _one_per_package(fam)[0]
    files = repo.base_files(task, fam.loaded.trees[task.base])
    tampered = {
        p: ("def test_nothing():\n    pass\n" if repo.is_test_file(p) else t)
        for p, t in files.items()
    }
    tampered["conftest.py"] = "import pytest\n"
    r = _judge(task, patches.diff(files, tampered))
    assert not r["passed"] and task.FAIL_TO_PASS[0] in r["rationale"]


def test_the_tools_edit_the_workspace_and_the_answer_is_its_diff(fam) -> None:
    task = _one_per_package(fam)[0]
    t = fam.sample(0)
    env = repo.RepoFamily.environment(fam._task(0, task.instance_id).spec)
    ws = env.workspace()
    box = repo.box(fam.cfg, "userns")
    site = task.source["mutation"]
    _, out = env.call_args(
        ws, "view", {"path": site["path"], "lines": f"{site['line']}-{site['line']}"}, box
    )
    assert out.status == "ok" and out.output.lstrip().startswith(str(site["line"]))
    _, found = env.call_args(ws, "search", {"pattern": "def "}, box)
    assert found.status == "ok" and ".py:" in found.output
    _, dup = env.call_args(ws, "replace", {"path": site["path"], "old": "", "new": "x"}, box)
    assert dup.status == "error" and "occurs 0 times" in dup.output
    _, made = env.call_args(ws, "create", {"path": "notes.txt", "content": "hi\n"}, box)
    assert made.status == "ok"
    _, again = env.call_args(ws, "create", {"path": "notes.txt", "content": "x"}, box)
    assert again.status == "error"
    _, applied = env.call_args(ws, "apply_patch", {"patch": task.patch}, box)
    assert applied.status == "ok", applied.output
    _, bad = env.call_args(ws, "apply_patch", {"patch": task.patch}, box)
    assert bad.status == "error" and "does not apply" in bad.output  # nothing half-applied
    _, ran = env.call_args(ws, "test", {"tests": " ".join(task.FAIL_TO_PASS[:2])}, box)
    assert ran.status == "ok" and "passed" in ran.output and "failed" not in ran.output, ran.output
    answer = env.final(ws)
    assert "+++ b/notes.txt" in answer
    assert _judge(task, answer)["passed"]
    assert t.task_id.startswith("repo-0:")


def test_a_broken_row_is_reported_and_the_rest_load(tmp_path: Path, fam) -> None:
    src = Path(repo.resolve(FILE)).read_text().splitlines()
    tree = next(line for line in src if '"tree"' in line[:20])
    task = json.loads(next(line for line in src if '"instance_id"' in line[:30]))
    rows = [
        tree,
        "{not json",
        json.dumps({**task, "FAIL_TO_PASS": []}),
        json.dumps({**task, "instance_id": "x1", "base": "nope"}),
        json.dumps(task),
        json.dumps(task),
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(rows) + "\n")
    loaded = repo.load(str(path))
    assert list(loaded.tasks) == [task["instance_id"]]
    assert [e.split(": ", 1)[0] for e in loaded.errors] == [f"{path}:{n}" for n in (2, 3, 4, 6)]
    assert "not JSON" in loaded.errors[0] and "FAIL_TO_PASS" in loaded.errors[1]
    assert "base tree 'nope'" in loaded.errors[2] and "duplicate" in loaded.errors[3]


def test_diffs_round_trip_and_paths_stay_inside() -> None:
    rng = random.Random(0)
    words = ["a\n", "b\n", "def f():\n", "    return 1\n", "\n"]
    for _ in range(500):
        base = {f"p{k}.py": "".join(rng.choices(words, k=rng.randint(0, 9))) + rng.choice(["", "z"])
                for k in range(rng.randint(0, 3))}  # fmt: skip
        files = {k: v for k, v in base.items() if rng.random() > 0.2}
        for k in files:
            lines = files[k].splitlines(keepends=True)
            lines.insert(rng.randint(0, len(lines)), rng.choice(words))
            files[k] = "".join(lines)
        if rng.random() < 0.3:
            files["new/n.py"] = rng.choice(["x\ny", ""])
        assert patches.apply(base, patches.diff(base, files)) == files
    for bad in ("/etc/passwd", "a/../../x", "b/.git/../../y"):
        with pytest.raises(patches.PatchError) as err:
            patches.apply({}, f"--- {bad}\n+++ {bad}\n@@ -0,0 +1 @@\n+x\n")
        assert err.value.outside


def test_tool_schemas_and_the_driver_constants() -> None:
    env = repo_tools.environment({"m.py": "x = 1\n"}, ["."], repo.box(repo.RepoConfig(), "userns"))
    names = [s["function"]["name"] for s in env.schemas()]
    assert names == ["view", "search", "replace", "create", "apply_patch", "test"]
    assert env.schemas()[0]["function"]["parameters"]["required"] == ["path"]
    assert "ROLE = 'answer'" in repo_tools.driver("answer", ["src"], ["t.py::x"])
