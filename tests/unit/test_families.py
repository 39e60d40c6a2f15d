"""Task-family plugins: the registry, task ids, mixing, and a user's own family end to end."""

from __future__ import annotations

import collections
import json
import sys
import textwrap
from pathlib import Path

import pytest

from rlstream.envs import family
from rlstream.envs import fx_tasks as tasks
from rlstream.envs.family import FamilySpec, family_of, pick_family
from rlstream.envs.judges import JudgeConfig, judge_format, judge_tests
from rlstream.ops.run.config import RunConfig, load_run_config
from rlstream.rollout.scheduler import SchedulerConfig, task_record


def test_builtin_families_are_entry_point_plugins() -> None:
    found = family.plugins()
    assert found["fx"] == "rlstream.envs.fx:FxFamily"
    assert found["dataset"] == "rlstream.envs.dataset:DatasetFamily"
    with pytest.raises(ValueError, match=r"no task-family plugin 'nope' \(registered: .*fx"):
        family.load_plugin("nope")


def test_task_ids_carry_their_family() -> None:
    assert family_of("fx-123") == "fx"
    assert family_of("mini-7:HumanEval/0") == "mini"
    for bad in ("fx", "-1", "Fx-1", "fx_1", ""):
        with pytest.raises(ValueError, match="does not name its family"):
            family_of(bad)


def test_one_family_releases_exactly_the_tasks_of_before() -> None:
    """The default recipe (fx only) releases the same task ids, prompts and seeds as ever."""
    cfg = load_run_config().role("scheduler")
    assert isinstance(cfg, SchedulerConfig)
    for index in range(20):
        rec = task_record("r", cfg, index, 0)
        old = tasks.sample_task(cfg.seed * 1_000_000 + index, cfg.tasks)
        assert (rec["task_id"], rec["prompt"], rec["seed"]) == (old.task_id, old.prompt, old.seed)
        assert rec["family"] == "fx"
        assert json.loads(rec["spec_json"])["tasks"] == cfg.tasks.model_dump(mode="json")


def test_families_mix_by_weight_deterministically() -> None:
    specs = {"fx": FamilySpec(weight=3.0), "mini": FamilySpec(plugin="dataset", weight=1.0)}
    picks = [pick_family(specs, 5, i) for i in range(2000)]
    assert picks == [pick_family(specs, 5, i) for i in range(2000)]
    share = collections.Counter(picks)["fx"] / len(picks)
    assert 0.70 < share < 0.80
    cfg = SchedulerConfig(families=specs, seed=5)
    recs = [task_record("r", cfg, i, 0) for i in range(40)]
    assert {r["family"] for r in recs} == {"fx", "mini"}
    for rec in recs:
        assert family_of(rec["task_id"]) == rec["family"]
        assert "test" not in json.loads(rec["spec_json"]), "hidden tests never leave the family"
    assert len({r["task_id"] for r in recs}) == len(recs), "a problem drawn twice is two tasks"


def test_a_bad_recipe_fails_when_it_loads() -> None:
    with pytest.raises(ValueError, match="no task-family plugin 'nope'"):
        RunConfig.model_validate({"families": {"x": {"plugin": "nope"}}})
    with pytest.raises(ValueError, match="family name 'my-fam' must match"):
        RunConfig.model_validate({"families": {"my-fam": {"plugin": "fx"}}})
    with pytest.raises(
        ValueError, match=r"family 'fx' \(plugin 'fx'\) options: n_hidden: Input should be"
    ):
        RunConfig.model_validate({"families": {"fx": {"options": {"n_hidden": 0}}}})
    with pytest.raises(ValueError, match="cannot read the dataset"):
        RunConfig.model_validate(
            {"families": {"d": {"plugin": "dataset", "options": {"path": "/nonexistent.jsonl"}}}}
        )


def test_judges_refuse_tasks_of_families_the_run_does_not_have() -> None:
    cfg = JudgeConfig(kind="tests")
    reward = judge_tests({"task_id": "mini-1:mini/0", "completion": "x"}, cfg)
    assert reward["score"] == 0.0 and "not in this run" in reward["error"]
    assert "error" in judge_format({"task_id": "nonsense", "completion": "x"}, cfg)


def test_environment_for_any_task_never_raises() -> None:
    fx_task = task_record("r", SchedulerConfig(), 0, 0)
    env = family.environment_for(fx_task)
    assert [t.name for t in env.tools] == ["python"] and not env.uses_workspace
    old = {**fx_task, "spec_json": json.dumps({"seed": 1, "tasks": {}})}  # before plugins
    assert [t.name for t in family.environment_for(old).tools] == ["python"]
    broken = {**fx_task, "spec_json": json.dumps({"plugin": "not-installed-here"})}
    env = family.environment_for(broken)
    _, result = env.call(env.workspace(), "print(1)", tasks.SCORE_SANDBOX)
    assert result.status == "refused" and "not-installed-here" in result.output


USER_PLUGIN = '''
from pydantic import BaseModel, ConfigDict, Field
from rlstream.envs.family import FamilyTask, TaskFamily, Verdict
from rlstream.envs.tools import code_only


class EchoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    word: str = Field("hello", description="What the answer must say.")


class EchoFamily(TaskFamily):
    """A user's family: say the word."""

    plugin = "echo_test"
    Config = EchoConfig

    def sample(self, seed, split="train"):
        key = f"{split}{seed}"
        return FamilyTask(f"{self.name}-{key}", f"say {self.cfg.word}", {"plugin": "echo_test"}, seed)

    def score(self, task_id, completion, isolation="full"):
        self.key(task_id)
        ok = completion.strip() == self.cfg.word
        return Verdict(ok, float(ok), "said it" if ok else f"expected {self.cfg.word!r}")

    def format_check(self, task_id, completion):
        return (bool(completion.strip()), "empty")

    def answer(self, completion):
        return completion.strip()

    @classmethod
    def environment(cls, spec):
        return code_only()
'''


def test_a_users_package_adds_a_family_without_touching_rlstream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package on the path declaring an entry point is a family a recipe can name."""
    (tmp_path / "echo_family.py").write_text(textwrap.dedent(USER_PLUGIN))
    dist = tmp_path / "echo_family-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-family\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[rlstream.task_families]\necho_test = echo_family:EchoFamily\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "echo_test" in family.plugins()
    run = RunConfig.model_validate(
        {"families": {"fx": {}, "echo": {"plugin": "echo_test", "options": {"word": "hi"}}}}
    )
    sched = run.role("scheduler")
    assert isinstance(sched, SchedulerConfig)
    recs = [task_record("r", sched, i, 0) for i in range(12)]
    echo = next(r for r in recs if r["family"] == "echo")
    assert echo["prompt"] == "say hi" and echo["task_id"].startswith("echo-")
    judge = run.role("judge", "tests")
    assert isinstance(judge, JudgeConfig)
    good = judge_tests({"task_id": echo["task_id"], "completion": "hi"}, judge)
    bad = judge_tests({"task_id": echo["task_id"], "completion": "bye"}, judge)
    assert good["passed"] and good["details"] == {"isolation.not_run": 1.0}
    assert not bad["passed"] and bad["rationale"] == "expected 'hi'"
    sys.modules.pop("echo_family", None)
