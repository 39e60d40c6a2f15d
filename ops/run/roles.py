"""The roles of a run, each declared once.

``ROLES`` declares every principal of a run: the roles ``rlstream run`` starts and the network
services of ``rlstream serve``. One ``Role`` record says its name, the module that runs it (a
role's module exposes ``run_role(ctx: RoleContext)``), the section of the run recipe that holds
its config and how the run's shared values are injected into it (``configure``), and what it
does with Kafka (``access``). Everything else is derived from that record, never listed again:
the ``rlstream run`` subcommands (``ops.cli.cmd_run``), the dispatch (``ops.run.role_main``), the config
chain (``RunConfig.role``), the principals and their ACLs (``ops.run.acls``) and the users of
``rlstream serve`` (``ops.cli.cmd_serve``). This module imports the standard library only, so
the command line that reads it starts fast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlstream.schemas import topics

if TYPE_CHECKING:
    from pydantic import BaseModel

    from rlstream.ops.run.config import RunConfig

#: A supervised role's transactional call that blocks this long is abandoned and its producer
#: replaced in the process (``producers.client.producer``; ``RLSTREAM_HUNG_TRANSACTION_S``
#: overrides it). A healthy call returns in well under a second, and one held up by a
#: coordinator that moves within a few; a false alarm costs one aborted batch, redone.
HUNG_TRANSACTION_S = 10.0


@dataclass(frozen=True, slots=True)
class RoleAccess:
    """What one role does with Kafka, in the catalog's terms."""

    reads: tuple[str, ...]
    """Streams it consumes or reads to the end."""
    writes: tuple[str, ...]
    """Streams it produces to."""
    group: str | None
    """Suffix of its consumer group ``rlstream.RUN.<group>``; None: it joins no group."""
    group_prefix: bool = False
    """True when several groups share the suffix as a prefix (one judge group per rubric)."""
    transactional: bool = True
    """Whether it writes in transactions (ids ``rlstream.RUN.<role>`` or ``...<role>.*``)."""
    prunes: tuple[str, ...] = ()
    """Streams whose old records it deletes (``DeleteRecords``)."""


Configure = Callable[["RunConfig", "str | None"], "BaseModel"]


@dataclass(frozen=True, slots=True)
class Role:
    """One role or service of a run, declared once (see the module docstring)."""

    name: str
    """The role's name: ``rlstream run NAME``, its Kafka principal ``User:NAME``, its group."""
    module: str
    """The module that runs it (a role's exposes ``run_role(ctx)``)."""
    access: RoleAccess
    """What it reads, writes and prunes (its ACLs follow: ``ops.run.acls``)."""
    section: str | None = None
    """The run recipe's section of its config (None: a service, configured on its command)."""
    configure: Configure | None = None
    """Its config from the run's: the section with the shared values injected."""
    serve: str | None = None
    """A network service: its ``rlstream serve`` subcommand (not started by ``rlstream run``)."""
    named: bool = False
    """Several of it run side by side, each picked by ``--name`` (the judges, one per rubric)."""
    example: str = ""
    """A ``--name`` to show in errors (named roles)."""


# --- how each role gets its config (the shared values set once at the top of the recipe) ------


def derive(model: BaseModel, /, **changes: Any) -> BaseModel:
    """``schemas.derive.derive``, imported when a config is made (this module stays stdlib)."""
    from rlstream.schemas.derive import derive as validated

    return validated(model, **changes)


def _scheduler(run: RunConfig, name: str | None) -> BaseModel:
    shared: dict[str, Any] = {"group_size": run.group_size, "groups_per_step": run.groups_per_step}
    shared |= {"max_staleness": run.max_staleness, "seed": run.seed}
    shared |= {"oversample": run.sync_oversample}
    return derive(run.scheduler, **shared, tasks=run.tasks, families=run.families)


def _rollout(run: RunConfig, name: str | None) -> BaseModel:
    box = derive(run.rollout.harness.tool_sandbox, isolation=run.isolation)
    harness = derive(run.rollout.harness, tool_sandbox=box)
    shared = {"model": run.model, "policy": run.policy, "seed": run.seed}
    return derive(run.rollout, **shared, harness=harness, max_staleness=run.max_staleness)


def _judge(run: RunConfig, name: str | None) -> BaseModel:
    if name not in run.judges:
        raise SystemExit(f"error: no judge {name!r} in the config (have {sorted(run.judges)})")
    shared = {"families": run.families, "isolation": run.isolation, "policy_model": run.model}
    return derive(run.judges[name], tasks=run.tasks, **shared)


def _admission(run: RunConfig, name: str | None) -> BaseModel:
    capped = run.max_staleness == 0 and run.sync_oversample > 1
    cap = run.groups_per_step if capped else run.admission.max_groups_per_version
    # admission.judges: the run's judges by their weights unless the recipe names them
    # (RunConfig fills and checks them)
    return derive(run.admission, max_staleness=run.max_staleness, max_groups_per_version=cap)


def _learner(run: RunConfig, name: str | None) -> BaseModel:
    warm = derive(run.learner.warm_start, task=run.tasks)
    shared = {"model": run.model, "policy": run.policy, "seed": run.seed}
    mix = {
        "mix_online_groups": run.feedback_rl.mix_online_groups,
        "mix_rollout_groups": run.feedback_rl.mix_rollout_groups,
    }
    return derive(
        run.learner, **shared, groups_per_step=run.groups_per_step, warm_start=warm, **mix
    )


def _eval(run: RunConfig, name: str | None) -> BaseModel:
    rollout: Any = _rollout(run, None)
    harness = derive(rollout.harness, max_turns=run.scheduler.max_turns)
    shared = {"model": run.model, "policy": run.policy, "families": run.families}
    shared |= {"tasks": run.tasks, "isolation": run.isolation, "seed": run.seed}
    return derive(run.eval, **shared, harness=harness)


def _tracker(run: RunConfig, name: str | None) -> BaseModel:
    return run.tracker


def _capacity(run: RunConfig, name: str | None) -> BaseModel:
    return run.capacity


def _feedback_rl(run: RunConfig, name: str | None) -> BaseModel:
    # Online feedback may keep its own staleness budget; by default it is the run's.
    update: dict[str, Any] = {"model": run.model}
    if "max_staleness" not in run.feedback_rl.model_fields_set:
        update["max_staleness"] = run.max_staleness
    return derive(run.feedback_rl, **update)


# --- the declaration ---------------------------------------------------------------------------

_ROLES = (
    Role(
        "scheduler",
        "rlstream.rollout.scheduler",
        RoleAccess(
            # preempted: reclaimed groups released again; capacity: where to release
            reads=("tasks", "weights.manifests", "admitted", "rejected", "preempted", "capacity"),
            writes=("tasks",),
            group=None,
            transactional=False,
        ),
        section="scheduler",
        configure=_scheduler,
    ),
    Role(
        "rollout",
        "rlstream.rollout.worker",
        RoleAccess(
            reads=("tasks", "weights.manifests", "weights.chunks", "capacity"),
            writes=("trajectories", "preempted", "dlq"),
            group="rollout",
        ),
        section="rollout",
        configure=_rollout,
    ),
    Role(
        "judge",
        "rlstream.envs.judges",
        RoleAccess(
            reads=("trajectories",), writes=("rewards", "dlq"), group="judge.", group_prefix=True
        ),
        section="judges",
        configure=_judge,
        named=True,
        example="tests",
    ),
    Role(
        "admission",
        "rlstream.consumers.admission",
        RoleAccess(
            # tasks: a group is admitted only for a task released to the region it came from
            reads=("tasks", "trajectories", "rewards", "weights.manifests", "admitted", "rejected"),
            writes=("admitted", "rejected", "dlq"),
            group="admission",
        ),
        section="admission",
        configure=_admission,
    ),
    Role(
        "learner",
        "rlstream.trainer.learner",
        RoleAccess(
            reads=("admitted", "weights.manifests", "weights.chunks"),
            writes=("weights.manifests", "weights.chunks", "dlq"),
            group="learner",
            prunes=(
                "weights.chunks",
            ),  # chunks no kept keyframe needs (producers.weights.retention)
        ),
        section="learner",
        configure=_learner,
    ),
    Role(
        "feedback-rl",
        "rlstream.consumers.feedback.rl",
        RoleAccess(
            # served only: a feedback's trajectory_ref may name nothing else (served_log)
            reads=("feedback", "served", "weights.manifests", "admitted", "rejected"),
            writes=("admitted", "rejected", "dlq"),
            group="feedback-rl",
        ),
        section="feedback_rl",
        configure=_feedback_rl,
    ),
    Role(
        "eval",
        "rlstream.rollout.evaluator",
        RoleAccess(
            reads=("weights.manifests", "weights.chunks", "evals"), writes=("evals",), group=None
        ),
        section="eval",
        configure=_eval,
    ),
    Role(
        "capacity",
        "rlstream.rollout.capacity",  # one per region: what its serving fleet lends
        RoleAccess(reads=(), writes=("capacity",), group=None, transactional=False),
        section="capacity",
        configure=_capacity,
    ),
    Role(
        "tracker",
        "rlstream.ops.observe.tracker",  # reads like the dashboard: no group, writes no stream
        RoleAccess(
            # every stream of the run its reader follows (ops.observe.analytics.STREAMS)
            reads=tuple(s for s in topics.RUN_STREAMS if s != "weights.chunks"),
            writes=(),
            group=None,
            transactional=False,
        ),
        section="tracker",
        configure=_tracker,
    ),
    # the network services of `rlstream serve`, each its own principal too
    Role(
        "feedback-ingest",
        "rlstream.producers.feedback.service",  # its durable dedupe reads the feedback back
        RoleAccess(reads=("feedback",), writes=("feedback",), group=None, transactional=False),
        serve="feedback",
    ),
    Role(
        "policy-server",
        "rlstream.rollout.serve",  # weights, releases (evals), records what it served
        RoleAccess(
            reads=("weights.manifests", "weights.chunks", "evals"),
            writes=("served",),
            group=None,
            transactional=False,
        ),
        serve="policy",
    ),
    Role(
        "vllm-follower",
        "rlstream.rollout.vllm_follow",  # a vLLM server of its own kept on the newest version
        RoleAccess(
            reads=("weights.manifests", "weights.chunks"),
            writes=(),
            group=None,
            transactional=False,
        ),
        serve="vllm",
    ),
)
#: Every role and service of a run, by name, in the order ``--help`` and the ACLs list them.
ROLES: dict[str, Role] = {r.name: r for r in _ROLES}
#: What ``rlstream run`` starts.
RUN_ROLES: tuple[str, ...] = tuple(r.name for r in _ROLES if r.serve is None)
#: The principal of each ``rlstream serve`` subcommand.
SERVICES: dict[str, str] = {r.serve: r.name for r in _ROLES if r.serve is not None}


def role_config(run: RunConfig, role: str, name: str | None = None) -> BaseModel:
    """The config of ``role`` (a named role's ``name``) with the run's shared values injected."""
    spec = ROLES.get(role)
    if spec is None or spec.configure is None:
        raise SystemExit(f"error: unknown role {role!r}")
    return spec.configure(run, name)
