"""``rlstream run ROLE --run RUN [options]``: start one role of a run against any cluster.

Every role is one process; every consuming role is one consumer group whose id is derived
(``rlstream.RUN.ROLE[.NAME]``). Role options come from the role's typed config: a TOML recipe
(``--config``) and ``--set key=value`` overrides on top; the resolved config is printed.
"""

from __future__ import annotations

import argparse

from rlstream.ops.kafka_env import add_kafka_args

#: What ``rlstream run`` starts: the roles of ``ops.roles.ROLES`` (one module each, entry point
#: ``run_role(ctx)``), plus ``tap``, which reads a stream and belongs to no role's group.
ROLE_NAMES = ("tap", "scheduler", "rollout", "judge", "admission", "learner", "feedback-rl")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("run", help="start one role of a run (tap, scheduler, rollout, ...)")
    rsub = parser.add_subparsers(dest="role", metavar="ROLE", required=True)
    for role in ROLE_NAMES:
        rp = rsub.add_parser(role, help=f"run the {role} role")
        rp.add_argument("--run", required=True, help="run name (topics rl.RUN.*)")
        if role == "tap":
            from rlstream.ops.cmd_events import add_tap_args

            add_tap_args(rp)
        else:
            rp.add_argument("--name", default=None, help="judge name (judge role only), e.g. tests")
            rp.add_argument(
                "--member",
                default=None,
                help="stable member name (static membership, transactional id)",
            )
            rp.add_argument("--config", default=None, help="TOML recipe with the role's config")
            rp.add_argument(
                "--set",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="override one config field, repeatable",
            )
        add_kafka_args(rp)
        rp.set_defaults(func=_run_role)


def _run_role(args: argparse.Namespace) -> int:
    if args.role == "tap":
        from rlstream.ops.cmd_events import tap_role

        return tap_role(args)
    from rlstream.ops.roles import start

    return start(args)
