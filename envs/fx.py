"""The ``fx`` task family as a plugin (entry point ``fx``): :mod:`rlstream.envs.fx_tasks` behind
the :class:`~rlstream.envs.family.TaskFamily` interface.

Rules: a task id is ``NAME-SEED`` (``fx-SEED`` in the default recipe, as it always was); the
spec rollout workers get is ``{"plugin": "fx", "seed", "tasks"}`` and nothing hidden (the hidden
inputs and outputs are rebuilt from the seed by the judge); held-out tasks are split by spec
(``tasks.split_of_steps``), so their seeds (``EVAL_SEED_BASE`` and up) never yield a trained spec,
and the eval set (``eval_tasks``) holds each held-out spec once; the one tool is Python code in the
sandbox (``<run>CODE</run>``), with no workspace; scoring is ``tasks.score`` with its hacking
guards, in a sandbox of at least the isolation the judge accepts.
"""

from __future__ import annotations

import random
from typing import Any

from rlstream.envs import fx_tasks as tasks
from rlstream.envs import protocol, sandbox
from rlstream.envs.family import FamilySpec, FamilyTask, Split, TaskFamily, Verdict
from rlstream.envs.tools import Environment, code_only
from rlstream.schemas.derive import derive


class FxFamily(TaskFamily):
    """Tiny functions from a spoken spec (see :mod:`rlstream.envs.fx_tasks`)."""

    plugin = "fx"
    Config = tasks.TaskConfig
    cfg: tasks.TaskConfig

    def task(self, task_id: str) -> tasks.Task:
        """The task behind ``task_id``, hidden tests included; ValueError for a foreign id."""
        seed = self.key(task_id)
        if not seed.lstrip("-").isdigit():
            raise ValueError(f"task id {task_id!r} is not of the fx family ({self.name}-SEED)")
        return tasks.sample_task(int(seed), self.cfg)

    def split_of_task(self, task_id: str) -> Split:
        """``eval`` for a held-out seed (``EVAL_SEED_BASE`` and up), else ``train``."""
        seed = self.key(task_id)
        if not seed.lstrip("-").isdigit():
            raise ValueError(f"task id {task_id!r} is not of the fx family ({self.name}-SEED)")
        return "eval" if tasks.split_of_seed(int(seed)) == "eval" else "train"

    def sample(self, seed: int, split: Split = "train") -> FamilyTask:
        """Seeds ``0 .. EVAL_SEED_BASE``; held-out tasks have seed ``EVAL_SEED_BASE + seed``
        and a held-out spec (``tasks.split_of_steps``)."""
        if not 0 <= seed < tasks.EVAL_SEED_BASE:
            raise ValueError(f"fx seeds lie in [0, {tasks.EVAL_SEED_BASE}), not {seed}")
        seed += tasks.EVAL_SEED_BASE if split == "eval" else 0
        task = tasks.sample_task(seed, self.cfg)
        spec = {"plugin": self.plugin, "seed": seed, "tasks": self.cfg.model_dump()}
        return FamilyTask(f"{self.name}-{seed}", task.prompt, spec, seed)

    def eval_tasks(self, n: int) -> list[FamilyTask]:
        """The first ``n`` held-out tasks of distinct specs, in seed order (fewer if the split
        holds fewer specs): each held-out function counts once, however often it is drawn."""
        out: list[FamilyTask] = []
        specs: set[str] = set()
        for i in range(max(64, 50 * n)):
            if len(out) >= n:
                break
            task = self.sample(i, "eval")
            spec = tasks.spec_text(self.task(task.task_id).steps)
            if spec not in specs:
                specs.add(spec)
                out.append(task)
        return out

    def score(self, task_id: str, completion: str, isolation: sandbox.Mode = "full") -> Verdict:
        box = derive(tasks.SCORE_SANDBOX, isolation=isolation)
        passed, details = tasks.score(self.task(task_id), completion, box)
        numbers = {k: float(v) for k, v in details.items() if isinstance(v, int | float)}
        mode = str(details.get("isolation") or "not_run")
        if details.get("sandbox_status") == "error":
            why = "sandbox could not run the answer"
            return Verdict(False, 0.0, why, numbers, mode, error=why)
        reason = str(details.get("reason", "all hidden tests pass"))
        return Verdict(passed, 1.0 if passed else 0.0, reason, numbers, mode)

    def demonstration(
        self, task: FamilyTask, rng: random.Random, teacher: tasks.TeacherConfig | None = None
    ) -> str:
        """The weak teacher's answer (``tasks.demonstration``: each step right with probability
        ``p_correct``, an echo of the visible example with ``p_hack``)."""
        return tasks.demonstration(self.task(task.task_id), rng, teacher)

    def format_check(self, task_id: str, completion: str) -> tuple[bool, str]:
        return tasks.format_check(completion)

    def answer(self, completion: str) -> str:
        return protocol.final_answer(completion)

    @classmethod
    def environment(cls, spec: dict[str, Any]) -> Environment:
        return code_only()


def with_fx_options(
    specs: dict[str, FamilySpec], shared: tasks.TaskConfig
) -> dict[str, FamilySpec]:
    """``specs`` with the run's shared fx difficulty as the options of fx families giving none."""
    return {
        name: derive(spec, options=shared.model_dump())
        if spec.plugin == FxFamily.plugin and not spec.options
        else spec
        for name, spec in specs.items()
    }
