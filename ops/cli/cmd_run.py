"""``rlstream run ROLE --run RUN [options]``: start one role of a run against any cluster.

Every role is one process; every consuming role is one consumer group whose id is derived
(``rlstream.RUN.ROLE[.NAME]``). Role options come from the role's typed config: a TOML recipe
(``--config``) and ``--set key=value`` overrides on top; the resolved config is printed.

A role runs supervised (``ops.run.supervise``): the command starts it as a child process and
restarts it with backoff when it fails, giving up with a message after repeated fast failures.

``rlstream run learner --ranks N`` (or ``learner.ranks = N``) runs the learner as N ranks on
torch.distributed: the supervised child launches them (``ops.run.ranks``) and fails when one fails,
so all restart together. Under ``torchrun`` (``WORLD_SIZE`` in the environment) the command runs
one rank, unsupervised: torchrun starts, watches and restarts the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys

from rlstream.ops.run.kafka_env import add_kafka_args
from rlstream.ops.run.roles import RUN_ROLES

#: What ``rlstream run`` starts: the roles declared in ``ops.run.roles`` (one module each, entry
#: point ``run_role(ctx)``), plus ``tap``, which reads a stream and belongs to no role's group.
ROLE_NAMES = ("tap", *RUN_ROLES)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("run", help="start one role of a run (tap, scheduler, rollout, ...)")
    rsub = parser.add_subparsers(dest="role", metavar="ROLE", required=True)
    for role in ROLE_NAMES:
        rp = rsub.add_parser(role, help=f"run the {role} role")
        rp.add_argument("--run", required=True, help="run name (topics rl.RUN.*)")
        if role == "tap":
            from rlstream.ops.cli.cmd_events import add_tap_args

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
            rp.add_argument(
                "--max-fast-failures",
                type=int,
                default=5,
                help="give up after this many failures in a row, each within 30 s of a start",
            )
            rp.add_argument(
                "--restart-backoff",
                type=float,
                default=1.0,
                help="seconds before the first restart; doubles per failure, up to 30",
            )
            rp.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
            if role == "learner":
                rp.add_argument(
                    "--ranks",
                    type=int,
                    default=None,
                    help="data-parallel ranks on torch.distributed, started and watched here "
                    "(sets learner.ranks; under torchrun WORLD_SIZE decides)",
                )
        add_kafka_args(rp)
        rp.set_defaults(func=_run_role)


def _run_role(args: argparse.Namespace) -> int:
    if args.role == "tap":
        from rlstream.ops.cli.cmd_events import tap_role

        return tap_role(args)
    # the supervised child, or one rank under torchrun (which supervises the ranks itself)
    if args.once or (args.role == "learner" and "WORLD_SIZE" in os.environ):
        from rlstream.ops.run.role_main import start

        return start(args)
    from rlstream.ops.run.supervise import RestartPolicy, supervise

    policy = RestartPolicy(base_s=args.restart_backoff, max_fast=args.max_fast_failures)
    child = [sys.executable, "-m", "rlstream", *sys.argv[1:], "--once"]
    name = args.role + (f".{args.name}" if args.name else "")
    return supervise(f"{name} ({args.run})", child, policy)
