"""A run's configuration: one typed model, a TOML recipe, command-line overrides on top.

Values every role must agree on (seed, model name, policy shape, task family, group size, step
size, staleness budget) are set once at the top of the recipe and injected into each role's own
config by ``RunConfig.role``; the resolved config is what the run manifest records.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlstream.consumers.admission_rules import AdmissionConfig
from rlstream.consumers.feedback.rules import FeedbackRLConfig
from rlstream.envs import family as task_families
from rlstream.envs import sandbox
from rlstream.envs import tasks as task_family
from rlstream.envs.family import FamilySpec
from rlstream.envs.fx import with_fx_options
from rlstream.envs.judges import JudgeConfig
from rlstream.ops.run.regions import RegionsConfig
from rlstream.rollout.config import EvalConfig, PolicyConfig, RolloutConfig
from rlstream.rollout.scheduler import SchedulerConfig
from rlstream.trainer.config import LearnerConfig

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _default_judges() -> dict[str, JudgeConfig]:
    return {"tests": JudgeConfig(kind="tests"), "format": JudgeConfig(kind="format")}


class RunConfig(BaseModel):
    """Everything a run needs; see the module docstring for how roles get their part."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, ge=0, description="Run seed (tasks, sampling, learner).")
    model: str = Field("policy", description="Model name; key of the weight manifests.")
    group_size: int = Field(8, ge=2, le=1024, description="GRPO group size G.")
    groups_per_step: int = Field(4, ge=1, description="Admitted groups per learner step B.")
    max_staleness: int = Field(2, ge=0, description="Staleness budget (versions).")
    policy: PolicyConfig = Field(
        default_factory=lambda: PolicyConfig(vocab_size=task_family.VOCAB_SIZE),
        description="Policy architecture and shape, shared by every role that holds the model.",
    )
    tasks: task_family.TaskConfig = Field(
        default_factory=task_family.TaskConfig, description="Task family difficulty, shared."
    )
    families: dict[str, FamilySpec] = Field(
        default_factory=lambda: {"fx": FamilySpec()},
        description="Task families by name (task ids start with NAME-), with their weights; "
        "fx families without options take `tasks`.",
    )
    isolation: sandbox.Mode = Field(
        "full",
        description="Weakest sandbox isolation the run accepts (judges and tools): 'full', or "
        "explicitly a weaker 'userns' or 'rlimits'.",
    )
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="Scheduler.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout workers.")
    judges: dict[str, JudgeConfig] = Field(
        default_factory=_default_judges, description="Judge roles by name."
    )
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="Admission.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="Learner.")
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="Held-out evaluation and release gating."
    )
    feedback_rl: FeedbackRLConfig = Field(
        default_factory=FeedbackRLConfig, description="Online RL from editor feedback."
    )
    regions: RegionsConfig = Field(
        default_factory=RegionsConfig,
        description="Trainer and rollout regions, and how each region's Kafka is reached.",
    )

    @model_validator(mode="after")
    def _families_load(self) -> RunConfig:
        """Every family's plugin is installed and its options are valid, or the recipe fails."""
        try:
            task_families.families(self.run_families())
        except ValueError as exc:
            raise ValueError(f"families: {exc}") from exc
        return self

    def run_families(self) -> dict[str, FamilySpec]:
        """The families with the shared fx difficulty filled in."""
        return with_fx_options(self.families, self.tasks)

    def _judge(self, name: str | None) -> BaseModel:
        if name not in self.judges:
            raise SystemExit(f"error: no judge {name!r} in the config (have {sorted(self.judges)})")
        shared = {
            "families": self.families,
            "isolation": self.isolation,
            "policy_model": self.model,
        }
        return self.judges[name].model_copy(update={"tasks": self.tasks, **shared})

    def role(self, role: str, name: str | None = None) -> BaseModel:
        """The config of ``role`` (judge ``name``) with the shared values injected."""
        if role == "scheduler":
            return self.scheduler.model_copy(
                update={
                    "group_size": self.group_size,
                    "groups_per_step": self.groups_per_step,
                    "max_staleness": self.max_staleness,
                    "seed": self.seed,
                    "tasks": self.tasks,
                    "families": self.families,
                }
            )
        if role == "rollout":
            box = self.rollout.harness.tool_sandbox.model_copy(update={"isolation": self.isolation})
            harness = self.rollout.harness.model_copy(update={"tool_sandbox": box})
            return self.rollout.model_copy(
                update={
                    "model": self.model,
                    "policy": self.policy,
                    "seed": self.seed,
                    "harness": harness,
                    "max_staleness": self.max_staleness,
                }
            )
        if role == "judge":
            return self._judge(name)
        if role == "admission":
            return self.admission.model_copy(update={"max_staleness": self.max_staleness})
        if role == "learner":
            warm = self.learner.warm_start.model_copy(update={"task": self.tasks})
            return self.learner.model_copy(
                update={
                    "model": self.model,
                    "policy": self.policy,
                    "seed": self.seed,
                    "groups_per_step": self.groups_per_step,
                    "warm_start": warm,
                    "mix_online_groups": self.feedback_rl.mix_online_groups,
                    "mix_rollout_groups": self.feedback_rl.mix_rollout_groups,
                }
            )
        if role == "eval":
            rollout = self.role("rollout")
            assert isinstance(rollout, RolloutConfig)
            harness = rollout.harness.model_copy(update={"max_turns": self.scheduler.max_turns})
            return self.eval.model_copy(
                update={
                    "model": self.model,
                    "policy": self.policy,
                    "families": self.families,
                    "tasks": self.tasks,
                    "harness": harness,
                    "isolation": self.isolation,
                    "seed": self.seed,
                }
            )
        if role == "feedback-rl":
            # Online feedback may keep its own staleness budget; by default it is the run's.
            update: dict[str, Any] = {"model": self.model}
            if "max_staleness" not in self.feedback_rl.model_fields_set:
                update["max_staleness"] = self.max_staleness
            return self.feedback_rl.model_copy(update=update)
        raise SystemExit(f"error: unknown role {role!r}")


def load_run_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """The recipe at ``path`` (default: the demo recipe) with ``key.sub=value`` overrides."""
    data: dict[str, Any] = tomllib.loads(Path(path or RECIPES / "demo.toml").read_text())
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --set {item!r}: expected KEY=VALUE")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = data
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return RunConfig.model_validate(data)
