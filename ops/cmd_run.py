"""``rlstream run ROLE --run RUN [options]``: start one role of a run against any cluster.

Every role is one process; every consuming role is one consumer group whose id is derived
(``rlstream.RUN.ROLE[.NAME]``). Role options come from the role's typed config: a TOML recipe
(``--config``) and ``--set key=value`` overrides on top; the resolved config is printed.
"""

from __future__ import annotations

import argparse
import importlib

from rlstream.ops.kafka_env import add_kafka_args

#: role -> "module:function"; the function takes (args, settings) and returns an exit code.
ROLES = {
    "tap": "rlstream.ops.cmd_events:tap_role",
    "scheduler": "rlstream.ops.roles:scheduler",
    "rollout": "rlstream.ops.roles:rollout",
    "judge": "rlstream.ops.roles:judge",
    "admission": "rlstream.ops.roles:admission",
    "learner": "rlstream.ops.roles:learner",
    "feedback-rl": "rlstream.ops.roles:feedback_rl",
}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("run", help="start one role of a run (tap, scheduler, rollout, ...)")
    rsub = parser.add_subparsers(dest="role", metavar="ROLE", required=True)
    for role in ROLES:
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
    module, func = ROLES[args.role].split(":")
    return int(getattr(importlib.import_module(module), func)(args) or 0)
