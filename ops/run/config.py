"""A run's configuration: one typed model, a TOML recipe, command-line overrides on top.

Values every role must agree on (seed, model name, policy shape, task family, group size, step
size, staleness budget) are set once at the top of the recipe and injected into each role's own
config by ``RunConfig.role`` (each role's rule is declared with the role, ``ops.run.roles``); the
resolved config is what the run manifest records.
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
from rlstream.envs import fx_tasks as task_family
from rlstream.envs import protocol, sandbox
from rlstream.envs.family import FamilySpec
from rlstream.envs.fx import with_fx_options
from rlstream.envs.judges import JudgeConfig
from rlstream.ops.observe.tracker import TrackerConfig
from rlstream.ops.run.regions import RegionsConfig
from rlstream.ops.run.roles import role_config
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
    sync_oversample: float = Field(
        1.0,
        ge=1.0,
        le=4.0,
        description="Synchronous RL (max_staleness 0) only: release this many times the groups "
        "a step lacks at once, to cover no-signal rejections without a refill round; admission "
        "then admits one step's groups per version and rejects the rest as surplus.",
    )
    policy: PolicyConfig = Field(
        default_factory=lambda: PolicyConfig(vocab_size=protocol.VOCAB_SIZE),
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
    tracker: TrackerConfig = Field(
        default_factory=TrackerConfig, description="Experiment tracking (the tracker role)."
    )
    regions: RegionsConfig = Field(
        default_factory=RegionsConfig,
        description="Trainer and rollout regions, and how each region's Kafka is reached.",
    )

    @model_validator(mode="after")
    def _admission_judges_are_judges(self) -> RunConfig:
        """A reward admission waits for comes from a judge of the run, or no group completes."""
        unknown = sorted(set(self.admission.judges) - set(self.judges))
        if "judges" in self.admission.model_fields_set and unknown:
            raise ValueError(
                f"admission.judges names {', '.join(unknown)}, which [judges] does not define "
                f"(judges: {', '.join(sorted(self.judges)) or 'none'}); leave admission.judges "
                "out to wait for every judge, weighted by its own `weight`"
            )
        return self

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

    def role(self, role: str, name: str | None = None) -> BaseModel:
        """The config of ``role`` (judge ``name``) with the shared values injected (how, for
        each role: its ``configure`` in ``ops.run.roles``)."""
        return role_config(self, role, name)


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
