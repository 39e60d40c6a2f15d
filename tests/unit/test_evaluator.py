"""The eval role's rules: pass@k, which version is due, the release rule, the held-out set."""

from __future__ import annotations

import math

import pytest

from rlstream.consumers.weights.subscriber import Snapshot
from rlstream.envs.family import FamilySpec, family_of
from rlstream.ops.run.config import load_run_config
from rlstream.rollout import evaluator as ev
from rlstream.rollout.scheduler import SchedulerConfig, task_record


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert ev.pass_at_k(4, 0, 4) == 0.0
    assert ev.pass_at_k(4, 1, 4) == 1.0
    assert ev.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert ev.pass_at_k(10, 3, 2) == pytest.approx(1 - math.comb(7, 2) / math.comb(10, 2))
    with pytest.raises(ValueError):
        ev.pass_at_k(2, 3, 1)


def test_versions_are_due_in_order_and_never_skipped() -> None:
    assert ev.next_due([], 10) == 0
    assert ev.next_due([0], 10) == 10
    assert ev.next_due([0, 20], 10) == 10, "a gap is filled, not jumped"
    assert ev.next_due([0, 10, 20], 10) == 30


def test_release_rule_compares_with_the_last_released_version() -> None:
    assert ev.release(0.1, None, 0.05)[0]
    base = ev.Baseline(10, 0.50)
    assert ev.release(0.46, base, 0.05)[0]
    assert ev.release(0.45, base, 0.05)[0]
    ok, rule = ev.release(0.44, base, 0.05)
    assert not ok and rule.startswith("not greedy_success") and "v10" in rule
    ledger = ev.EvalLedger()
    ledger.add({"version": 0, "released": True, "greedy_success": 0.2})
    ledger.add({"version": 10, "released": False, "greedy_success": 0.1})
    ledger.add({"version": 20, "released": True, "greedy_success": 0.3})
    assert ledger.done == {0, 10, 20} and ledger.baseline == ev.Baseline(20, 0.3)


def test_held_out_set_is_fixed_and_never_released_for_training() -> None:
    config = load_run_config(None, ["eval.eval_tasks=40"])
    cfg = config.role("eval")
    assert isinstance(cfg, ev.EvalConfig)
    held = ev.held_out_set(cfg)
    assert len(held) == 40 and ev.task_set_id(held) == ev.task_set_id(ev.held_out_set(cfg))
    sched = config.role("scheduler")
    assert isinstance(sched, SchedulerConfig)
    train_prompts = {task_record("r", sched, i, 0)["prompt"].split("\n")[0] for i in range(3000)}
    assert not {t.prompt.split("\n")[0] for t in held} & train_prompts


def test_held_out_set_splits_over_families_by_weight() -> None:
    cfg = ev.EvalConfig(
        eval_tasks=8,
        families={"fx": FamilySpec(weight=3.0), "mini": FamilySpec(plugin="dataset")},
    )
    held = ev.held_out_set(cfg)
    names = [family_of(t.task_id) for t in held]
    assert names.count("fx") == 6 and 1 <= names.count("mini") <= 2


class _Subscriber:
    """Serves every version up to its ceiling except the refused ones (a ``Follower``)."""

    def __init__(self, refused: dict[int, str]) -> None:
        self.ceiling: int | None = None
        self.version: int | None = None
        self.refused = refused

    def wait_for(self, version: int, timeout: float = 30.0) -> Snapshot | None:
        assert self.ceiling == version, "the role caps the subscriber at the due version"
        if version not in self.refused:
            self.version = version
        return None if self.version is None else Snapshot(self.version, {})

    def refusal_of(self, version: int) -> str | None:
        return self.refused.get(version)


def test_a_refused_version_is_recorded_as_not_evaluated_and_the_next_one_is_due() -> None:
    sub = _Subscriber({4: "ManifestInvalid: tensor 'w' is float32[8], the model's is ..."})
    ledger, evaluated = ev.EvalLedger(), []
    for _ in range(20):  # the role's loop, without the evaluation itself
        target = ev.next_due(ledger.done | ledger.skipped.keys(), 2)
        if target > 8:
            break
        snap = ev.due_snapshot(sub, ledger, target, timeout=0.0)
        if snap is not None:
            ledger.done.add(snap.version)
            evaluated.append(snap.version)
    assert evaluated == [0, 2, 6, 8]
    assert list(ledger.skipped) == [4] and "ManifestInvalid" in ledger.skipped[4]
