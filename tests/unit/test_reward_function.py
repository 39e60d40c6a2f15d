"""A judge that is the user's reward function, named by dotted path: sync or async, returning a
float, a (score, rationale) pair or a Verdict; its failures are error rewards, a name that does
not import is refused when the judge starts."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlstream.envs.judges import Judge, JudgeConfig, judge_function, reward_function

REWARDS = """
import asyncio
from rlstream.envs.family import Verdict

def length(task, sample):
    return min(1.0, len(sample["completion"]) / 10)

def pair(task, sample):
    return 0.25, f"{task['family']} task {task['task_id']}"

def verdict(task, sample):
    return Verdict(True, 1.0, "all good")

async def later(task, sample):
    await asyncio.sleep(0)
    return 0.75

def boom(task, sample):
    raise KeyError("no such field")

def too_big(task, sample):
    return 3.0

def words(task, sample):
    return "great"
"""

SAMPLE = {"task_id": "fx-12", "prompt": "f(x): dbl", "completion": "return x*2"}


@pytest.fixture
def rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "my_rewards_mod.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_mod"
    sys.modules.pop("my_rewards_mod", None)
    reward_function.cache_clear()


def _judge(module: str, name: str) -> dict:
    return judge_function(SAMPLE, JudgeConfig(kind="function", reward=f"{module}:{name}"))


def test_what_a_reward_function_returns_becomes_the_reward(rewards: str) -> None:
    assert _judge(rewards, "length")["score"] == 1.0
    paired = _judge(rewards, "pair")
    assert paired["score"] == 0.25 and not paired["passed"]
    assert paired["rationale"] == "fx task fx-12"  # it got the task's family and id
    assert _judge(rewards, "verdict")["passed"]
    assert _judge(rewards, "later")["score"] == 0.75  # async functions are awaited


@pytest.mark.parametrize(
    ("name", "why"),
    [("boom", "KeyError"), ("too_big", "outside [0, 1]"), ("words", "returned str")],
)
def test_a_failing_reward_is_an_error_reward_never_a_crash(
    rewards: str, name: str, why: str
) -> None:
    reward = _judge(rewards, name)
    assert reward["score"] == 0.0 and not reward["passed"]
    assert why in reward["error"]


def test_a_reward_that_cannot_be_had_is_refused_at_start(rewards: str) -> None:
    with pytest.raises(SystemExit, match="cannot import no_such_module"):
        Judge("r", "mine", JudgeConfig(kind="function", reward="no_such_module:f"))
    with pytest.raises(SystemExit, match="has no function 'missing'"):
        Judge("r", "mine", JudgeConfig(kind="function", reward=f"{rewards}:missing"))


def test_only_a_function_judge_names_a_reward() -> None:
    with pytest.raises(ValidationError, match="names its `reward`"):
        JudgeConfig(kind="function")
    with pytest.raises(ValidationError, match="names its `reward`"):
        JudgeConfig(kind="tests", reward="m:f")
    with pytest.raises(ValidationError, match="pattern"):
        JudgeConfig(kind="function", reward="not a path")
