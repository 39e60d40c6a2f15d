"""Task families: the plugin interface, its registry, and how a run mixes families.

A *task family* samples tasks from a seed, says what the policy sees, keeps its hidden tests,
offers tools and scores answers in the sandbox. Every family (``fx`` and ``dataset`` too) is a
:class:`TaskFamily` subclass registered under the entry-point group ``rlstream.task_families``.

Rules a maintainer must keep:
- a task id is ``NAME-KEY`` and carries its family; NAME matches ``[a-z][a-z0-9_]*``;
- sampling is a pure function of (run seed, task index); with one family nothing is drawn;
- held-out tasks are disjoint from training tasks by construction (split by content, never by
  seed), and hidden tests never leave the family;
- the warm start's demonstrations go through this interface, never around it;
- ``score`` never raises for the answer's faults; every verdict records its isolation.

Details: docs/task-families.md (The plugin interface).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlstream.envs import sandbox
from rlstream.envs.tools import Environment, unavailable

ENTRY_POINT_GROUP = "rlstream.task_families"
NAME_PATTERN = r"^[a-z][a-z0-9_]{0,39}$"
_NAME = re.compile(NAME_PATTERN)
Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")
#: Task seeds a family samples from lie below this; a held-out task's seed is at or above it, so
#: no training draw ever names a held-out task (every family's ids follow it).
EVAL_SEED_BASE: Final = 10**12


class FamilySpec(BaseModel):
    """One family of a run: which plugin, how often, with which options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    plugin: str = Field(
        "fx",
        pattern=NAME_PATTERN,
        description=f"Plugin name: an entry point of the {ENTRY_POINT_GROUP!r} group.",
    )
    weight: float = Field(1.0, gt=0, le=1e6, description="Relative share of released tasks.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="The plugin's own config (validated by its Config)."
    )


@dataclass(frozen=True)
class FamilyTask:
    """One released task: its id (``NAME-KEY``), the prompt, and the spec rollout workers get."""

    task_id: str
    prompt: str
    spec: dict[str, Any]
    seed: int


@dataclass
class Verdict:
    """A family's score of one answer (see the module rules)."""

    passed: bool
    score: float
    rationale: str
    details: dict[str, float] = field(default_factory=dict)
    isolation: str = "not_run"  # the sandbox mode the answer ran under; not_run: no code ran
    error: str | None = None  # set when the answer could not be scored (not its fault)


class TaskFamily(ABC):
    """The plugin interface. Subclasses set ``plugin`` and ``Config`` and implement the rest."""

    plugin: ClassVar[str]
    Config: ClassVar[type[BaseModel]]

    def __init__(self, name: str, cfg: BaseModel) -> None:
        self.name, self.cfg = name, cfg

    @abstractmethod
    def sample(self, seed: int, split: Split = "train") -> FamilyTask:
        """The task of ``split`` with this seed: a pure function of the seed and the config.
        Tasks of different splits never share content (see the module rules)."""

    def eval_tasks(self, n: int) -> list[FamilyTask]:
        """The fixed held-out set: at most ``n`` tasks of the ``eval`` split (a family with
        fewer distinct held-out tasks may return fewer)."""
        return [self.sample(i, "eval") for i in range(n)]

    @abstractmethod
    def score(self, task_id: str, completion: str, isolation: sandbox.Mode = "full") -> Verdict:
        """Score ``completion`` for ``task_id`` (hidden tests rebuilt or looked up here), in a
        sandbox with at least ``isolation``; may raise ``sandbox.IsolationUnavailable``."""

    @abstractmethod
    def format_check(self, task_id: str, completion: str) -> tuple[bool, str]:
        """The format rubric: (well formed, why not)."""

    @abstractmethod
    def answer(self, completion: str) -> str:
        """The part of a completion that is scored (equal answers score equally)."""

    def demonstration(self, task: FamilyTask, rng: random.Random, teacher: Any = None) -> str:
        """A teacher's answer to ``task``, drawn with ``rng``: the supervised warm start's data
        (``trainer.warmstart``). ``teacher`` is the family's own teacher config (None: its
        default). A family without a teacher raises ``NotImplementedError``."""
        raise NotImplementedError(f"task family {self.plugin!r} has no demonstrations")

    def references(self) -> dict[str, str]:
        """Answers known to pass, by task id (an evaluation seed's, so held-out tasks are
        included): what ``env score --canonical`` and ``launch`` check every task against before
        a run trains on it. A family without reference answers returns none (unchecked)."""
        return {}

    @classmethod
    @abstractmethod
    def environment(cls, spec: dict[str, Any]) -> Environment:
        """Tools and starting workspace for one sample, from the task's spec alone."""

    def key(self, task_id: str) -> str:
        """The family's own part of ``task_id``; ValueError when it is not this family's."""
        name, sep, key = task_id.partition("-")
        if name != self.name or not sep:
            raise ValueError(
                f"task id {task_id!r} is not of family {self.name!r} ({self.name}-KEY)"
            )
        return key


def family_of(task_id: str) -> str:
    """The family name a task id carries (``NAME-KEY``); ValueError for any other shape."""
    name, sep, _ = task_id.partition("-")
    if not sep or not _NAME.match(name):
        raise ValueError(f"task id {task_id!r} does not name its family (FAMILY-KEY)")
    return name


# ---------------------------------------------------------------- the registry


#: rlstream's own families (also entry points of its ``pyproject.toml``): found even where the
#: installed package's metadata predates one of them.
BUILTIN: Final = {
    "fx": "rlstream.envs.fx:FxFamily",
    "dataset": "rlstream.envs.dataset:DatasetFamily",
    "repo": "rlstream.envs.repo:RepoFamily",
}


def plugins() -> dict[str, str]:
    """Registered plugin names -> their entry point's target (``module:Class``)."""
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {**BUILTIN, **{ep.name: ep.value for ep in eps}}


@functools.cache
def load_plugin(plugin: str) -> type[TaskFamily]:
    """The ``TaskFamily`` subclass registered as ``plugin``; ValueError with what exists."""
    eps = [
        ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == plugin
    ]
    if not eps and plugin in BUILTIN:
        module, _, name = BUILTIN[plugin].partition(":")
        return _checked(plugin, getattr(importlib.import_module(module), name), BUILTIN[plugin])
    if not eps:
        raise ValueError(
            f"no task-family plugin {plugin!r} (registered: {sorted(plugins())}); a package "
            f"registers one under the entry-point group {ENTRY_POINT_GROUP!r}"
        )
    return _checked(plugin, eps[0].load(), eps[0].value)


def _checked(plugin: str, cls: Any, target: str) -> type[TaskFamily]:
    if not (isinstance(cls, type) and issubclass(cls, TaskFamily)):
        raise ValueError(f"plugin {plugin!r} ({target}) is not a TaskFamily subclass")
    return cls


def build_family(name: str, spec: FamilySpec) -> TaskFamily:
    """A family instance of the run; ValueError (naming the family) for any bad option."""
    if not _NAME.match(name):
        raise ValueError(f"family name {name!r} must match {NAME_PATTERN} (no '-')")
    cls = load_plugin(spec.plugin)
    try:
        cfg = cls.Config.model_validate(spec.options)
    except ValidationError as exc:
        why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"family {name!r} (plugin {spec.plugin!r}) options: {why}") from exc
    return cls(name, cfg)


@functools.cache
def _families(frozen: str) -> dict[str, TaskFamily]:
    specs = {k: FamilySpec.model_validate(v) for k, v in json.loads(frozen).items()}
    return {name: build_family(name, spec) for name, spec in specs.items()}


def families(specs: dict[str, FamilySpec]) -> dict[str, TaskFamily]:
    """The run's families by name, built once per process for the same specs."""
    if not specs:
        raise ValueError("a run needs at least one task family")
    return _families(json.dumps({k: v.model_dump() for k, v in sorted(specs.items())}))


def family_for(specs: dict[str, FamilySpec], task_id: str) -> TaskFamily:
    """The family that owns ``task_id``; ValueError when the run has no such family."""
    name = family_of(task_id)
    built = families(specs)
    if name not in built:
        raise ValueError(f"task {task_id!r}: family {name!r} is not in this run ({sorted(built)})")
    return built[name]


def pick_family(specs: dict[str, FamilySpec], run_seed: int, index: int) -> str:
    """The family of task ``index``: a weighted draw seeded by (run seed, index)."""
    names = sorted(specs)
    if len(names) == 1:
        return names[0]
    rng = random.Random(f"{run_seed}/{index}")
    return rng.choices(names, weights=[specs[n].weight for n in names])[0]


def environment_for(task: dict[str, Any]) -> Environment:
    """The tools of a released task (a Task record), from its ``spec_json`` alone.

    Never raises: a task whose plugin is not installed here, or whose spec is unreadable, gets
    an environment whose every call is refused with the reason (recorded in the trajectory);
    a spec without ``plugin`` (written before plugins) is ``fx``'s.
    """
    try:
        spec = json.loads(task.get("spec_json") or "{}")
        return load_plugin(str(spec.get("plugin") or "fx")).environment(spec)
    except (ValueError, KeyError, TypeError, AttributeError, ImportError) as exc:
        return unavailable(f"{type(exc).__name__}: {exc}")
