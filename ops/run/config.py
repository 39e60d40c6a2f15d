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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
from rlstream.rollout.capacity import CapacityConfig
from rlstream.rollout.config import EvalConfig, PolicyConfig, RolloutConfig
from rlstream.rollout.scheduler import SchedulerConfig
from rlstream.schemas.derive import LOCAL, derive
from rlstream.schemas.errors import ConfigInvalid
from rlstream.trainer.config import LearnerConfig

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _default_judges() -> dict[str, JudgeConfig]:
    return {"tests": JudgeConfig(kind="tests"), "format": JudgeConfig(kind="format")}


class LaunchConfig(BaseModel):
    """Which processes ``rlstream launch`` (and ``demo``) start for a run; all of it local: how a
    run is deployed is not what its roles must agree on."""

    model_config = ConfigDict(extra="forbid")

    rollout_workers: int = Field(
        2,
        ge=1,
        le=256,
        description="Rollout worker processes, spread over the rollout regions in turn (the "
        "trainer region when there are none).",
        json_schema_extra=LOCAL,
    )
    lent_workers: int = Field(
        0,
        ge=0,
        le=256,
        description="Tidal capacity: rollout workers per rollout region whose engines are the "
        "serving fleet's (`rollout.lent`, slots 0..N-1), besides the dedicated ones; a "
        "capacity role is started in each region too.",
        json_schema_extra=LOCAL,
    )
    judge_members: int = Field(
        1,
        ge=1,
        le=64,
        description="Members of each judge's consumer group (processes per judge).",
        json_schema_extra=LOCAL,
    )
    eval: bool = Field(True, description="Start the held-out eval role.", json_schema_extra=LOCAL)
    tracker: bool = Field(
        True, description="Start the tracker role (MLflow).", json_schema_extra=LOCAL
    )
    feedback: bool = Field(
        False,
        description="Start feedback-rl (online RL from editor feedback; `serve feedback` and "
        "`serve policy` are started apart, on a host users reach).",
        json_schema_extra=LOCAL,
    )


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
    capacity: CapacityConfig = Field(
        default_factory=CapacityConfig,
        description="Tidal capacity: what each region's serving fleet lends to rollouts (the "
        "capacity role; rollout workers with `rollout.lent`).",
    )
    regions: RegionsConfig = Field(
        default_factory=RegionsConfig,
        description="Trainer and rollout regions, and how each region's Kafka is reached.",
    )
    launch: LaunchConfig = Field(
        default_factory=LaunchConfig,
        description="The processes `rlstream launch` starts (how many of each).",
        json_schema_extra=LOCAL,
    )

    @model_validator(mode="after")
    def _admission_judges_are_judges(self) -> RunConfig:
        """The rewards admission waits for: the run's judges, each by its own ``weight``,
        unless the recipe names ``admission.judges`` itself, from judges of the run only (or no
        group completes). Filled in here, so a recorded config reads back the same."""
        if "judges" not in self.admission.model_fields_set:
            weights = {name: judge.reward_weight() for name, judge in self.judges.items()}
            self.admission = derive(self.admission, judges=weights)
            return self
        unknown = sorted(set(self.admission.judges) - set(self.judges))
        if unknown:
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


def find_recipe(name_or_path: str) -> str:
    """A recipe file: ``name_or_path`` itself when it is a file, else the shipped recipe of that
    name (``ops/recipes/NAME.toml``); ``ConfigInvalid`` naming the shipped ones otherwise."""
    if Path(name_or_path).is_file():
        return name_or_path
    shipped = RECIPES / f"{name_or_path}.toml"
    if shipped.is_file():
        return str(shipped)
    known = ", ".join(sorted(p.stem for p in RECIPES.glob("*.toml")))
    raise ConfigInvalid(name_or_path, [f"no such file, nor a shipped recipe ({known})"])


def recipe_data(
    path: str | None = None, overrides: list[str] | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """The recipe at ``path`` (default: the demo recipe) with ``key.sub=value`` overrides, as
    plain data, and where each key set came from (``recipe`` or ``--set``), by dotted key.
    Raises ``ConfigInvalid`` for a file that cannot be read or parsed, or a malformed override."""
    where = Path(path or RECIPES / "demo.toml")
    try:
        data: dict[str, Any] = tomllib.loads(where.read_text())
    except OSError as exc:
        raise ConfigInvalid(str(where), [f"cannot read it: {exc.strerror or exc}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigInvalid(str(where), [f"not TOML: {exc}"]) from None
    sources = {key: "recipe" for key in _leaves(data)}
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigInvalid("--set", [f"{item!r}: expected KEY=VALUE"])
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = data
        *parents, leaf = key.strip().split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigInvalid("--set", [f"{key.strip()}: {part} is a value, not a table"])
            node = child
        node[leaf] = value
        sources[key.strip()] = "--set"
    _absolute_family_paths(data)
    return data, sources


def _absolute_family_paths(data: dict[str, Any]) -> None:
    """A family's ``path`` option (a task file) made absolute against the folder the command
    runs in: the recorded config then names the same file wherever it is read (replay,
    export, a role's start-up check from another folder)."""
    for spec in (data.get("families") or {}).values():
        options = spec.get("options") if isinstance(spec, dict) else None
        if not isinstance(options, dict):
            continue
        path = options.get("path")
        if isinstance(path, str) and path and ":" not in path and not Path(path).is_absolute():
            options["path"] = str(Path(path).expanduser().absolute())


def _leaves(data: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            keys += _leaves(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def problems_of(exc: ValidationError) -> list[str]:
    """``key: message`` for each error of a run config's validation."""
    lines = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "(recipe)"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "not a setting here (a typo, or a key of another section?)"
        elif error["type"] == "union_tag_not_found":
            tag = str(error.get("ctx", {}).get("discriminator", "kind")).strip("'")
            message = f"its `{tag}` picks which settings it takes: set {key}.{tag} too"
        lines.append(f"{key}: {message}")
    return lines


def load_run_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """The recipe at ``path`` (default: the demo recipe) with ``key.sub=value`` overrides.
    Raises ``ConfigInvalid`` (its ``problems``: one ``key: message`` line each)."""
    data, _ = recipe_data(path, overrides)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigInvalid(str(path or RECIPES / "demo.toml"), problems_of(exc)) from None
