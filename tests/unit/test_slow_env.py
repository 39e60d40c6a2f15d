"""The harness's ``slow`` family: the inner family's tasks, scores and tools, and an environment
that settles for a seeded, heavy-tailed time per group (``ops.bench.slow_env``)."""

from __future__ import annotations

import json

from rlstream.envs.family import FamilySpec, build_family, environment_for
from rlstream.ops.bench.slow_env import SlowFamily, group_seconds, slow_sets
from rlstream.ops.run.config import load_run_config


def _pair(sigma: float) -> tuple[SlowFamily, object]:
    inner = build_family("fx", FamilySpec(plugin="fx"))
    slow = build_family("fx", FamilySpec(plugin="slow", options={"median_s": 2, "sigma": sigma}))
    assert isinstance(slow, SlowFamily)
    return slow, inner


def test_tasks_and_scores_are_the_inner_familys() -> None:
    slow, inner = _pair(1.2)
    task, plain = slow.sample(5), inner.sample(5)  # type: ignore[attr-defined]
    assert (task.task_id, task.prompt) == (plain.task_id, plain.prompt)
    assert task.spec["plugin"] == "slow" and task.spec["slow"]["inner"] == "fx"
    answer = "def f(x):\n    return x\n"
    assert (
        slow.score(task.task_id, answer, "rlimits").passed
        == inner.score(  # type: ignore[attr-defined]
            plain.task_id, answer, "rlimits"
        ).passed
    )


def test_the_environment_settles_for_a_seeded_time() -> None:
    slow, _ = _pair(1.2)
    env = environment_for({"spec_json": json.dumps(slow.sample(3).spec)})
    assert env.settle is not None and env.tools  # the inner family's tools, and a settle time
    assert env.settle(8, 11) == env.settle(8, 11) == group_seconds(2, 1.2, 20, 8, 11)
    assert 0 < env.settle(8, 11) <= 20 and env.settle(8, 11) != env.settle(8, 12)
    still, _ = _pair(0)
    assert environment_for({"spec_json": json.dumps(still.sample(3).spec)}).settle(4, 1) == 2
    plain = environment_for(
        {"spec_json": json.dumps(build_family("fx", FamilySpec()).sample(3).spec)}
    )
    assert plain.settle is None  # a family of the product settles for nothing


def test_slow_sets_wrap_every_family_of_the_run_with_its_options() -> None:
    sets = ["tasks.n_hidden=4"]
    run = load_run_config(None, [*sets, *slow_sets(1.5, 0, None, sets)])
    spec = run.run_families()["fx"]
    assert spec.plugin == "slow"
    assert spec.options["inner_options"]["n_hidden"] == 4 and spec.options["median_s"] == 1.5
