"""The ``slow`` task family: another family whose environment keeps working after generation.

A benchmark or test that needs environment time (sandboxes on machines of their own, finishing
a group's work after its tokens are generated) wraps the run's families in this plugin instead
of the product reading a delay switch: every task, score and tool is the inner family's; only
the environment gains ``settle``, a heavy-tailed time per group (the largest of its samples'
lognormal draws, capped), seeded by the task so every process draws the same. The rollout
worker waits it out, or with ``rollout.env_overlap`` generates on meanwhile.

``slow_sets`` gives the ``--set`` that wraps every family of a run this way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from rlstream.envs.family import (
    NAME_PATTERN,
    FamilySpec,
    FamilyTask,
    Split,
    TaskFamily,
    Verdict,
    build_family,
    load_plugin,
)
from rlstream.envs.sandbox import Mode
from rlstream.envs.tools import Environment

PLUGIN = "slow"


class SlowConfig(BaseModel):
    """The inner family and its environment time per sample (lognormal)."""

    model_config = ConfigDict(extra="forbid")

    inner: str = Field("fx", pattern=NAME_PATTERN, description="The wrapped family's plugin.")
    inner_options: dict[str, Any] = Field(default_factory=dict, description="Its options.")
    median_s: float = Field(1.0, gt=0, le=60, description="Median seconds per sample.")
    sigma: float = Field(1.2, ge=0, le=4, description="Lognormal shape (tail weight).")
    cap_s: float = Field(20.0, gt=0, le=120, description="No draw exceeds this many seconds.")


def group_seconds(median_s: float, sigma: float, cap_s: float, size: int, seed: int) -> float:
    """A group's environment time: the largest of its samples' draws (they run side by side)."""
    draws = median_s * np.exp(sigma * np.random.default_rng(seed).standard_normal(size))
    return float(min(cap_s, draws.max()))


class SlowFamily(TaskFamily):
    """``cfg.inner``'s tasks, scores and tools; its environment settles for a drawn time."""

    plugin = PLUGIN
    Config = SlowConfig

    def __init__(self, name: str, cfg: BaseModel) -> None:
        super().__init__(name, cfg)
        assert isinstance(cfg, SlowConfig)
        self.inner = build_family(name, FamilySpec(plugin=cfg.inner, options=cfg.inner_options))
        self._delay = {"median_s": cfg.median_s, "sigma": cfg.sigma, "cap_s": cfg.cap_s}

    def _wrapped(self, task: FamilyTask) -> FamilyTask:
        spec = {**task.spec, "plugin": PLUGIN, PLUGIN: {"inner": self.inner.plugin, **self._delay}}
        return replace(task, spec=spec)

    def sample(self, seed: int, split: Split = "train") -> FamilyTask:
        return self._wrapped(self.inner.sample(seed, split))

    def eval_tasks(self, n: int) -> list[FamilyTask]:
        return [self._wrapped(task) for task in self.inner.eval_tasks(n)]

    def score(self, task_id: str, completion: str, isolation: Mode = "full") -> Verdict:
        return self.inner.score(task_id, completion, isolation)

    def format_check(self, task_id: str, completion: str) -> tuple[bool, str]:
        return self.inner.format_check(task_id, completion)

    def answer(self, completion: str) -> str:
        return self.inner.answer(completion)

    def demonstration(self, task: FamilyTask, rng: Any, teacher: Any = None) -> str:
        return self.inner.demonstration(task, rng, teacher)

    @classmethod
    def environment(cls, spec: dict[str, Any]) -> Environment:
        delay = spec[PLUGIN]
        inner = load_plugin(delay["inner"]).environment({**spec, "plugin": delay["inner"]})
        draw = partial(group_seconds, delay["median_s"], delay["sigma"], delay["cap_s"])
        return replace(inner, settle=draw)


def slow_sets(
    median_s: float, sigma: float, config: str | None = None, sets: Sequence[str] = ()
) -> list[str]:
    """The ``--set`` that wraps every family of the run (recipe ``config`` with ``sets``) in
    ``slow`` with this environment time, the inner options as the run resolves them."""
    from rlstream.ops.run.config import load_run_config

    run = load_run_config(config, list(sets))
    wrapped = {
        name: {
            "plugin": PLUGIN,
            "weight": spec.weight,
            "options": {
                "inner": spec.plugin,
                "inner_options": spec.options,
                "median_s": median_s,
                "sigma": sigma,
            },
        }
        for name, spec in run.run_families().items()
    }
    return [f"families={json.dumps(wrapped)}"]
