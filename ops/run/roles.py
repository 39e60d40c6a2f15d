"""Entry points of ``rlstream run ROLE``: parse the config first, then import the role.

Every role lives in one module that exposes ``run_role(ctx: RoleContext)``; ``ROLES`` names
that module. Starting a role resolves the run config (recipe + ``--set``), prints the role's
part, makes sure the run's topics exist (idempotent), installs SIGTERM/SIGINT handling, and
hands the role a ``RoleContext`` to run until stopped. A learner of several ranks
(``--ranks N`` or ``learner.ranks``) whose environment names no ranks yet is started as N rank
processes instead (``ops.run.ranks.launch``), each of which comes back here with its rank in its
environment. A role runs in one region (``--region``,
default the recipe's trainer region) and reaches that region's cluster only (``ops.run.regions``);
its topics there include the mirrored copies the region receives.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from rlstream.producers.client.producer import exit_when_hung
from rlstream.producers.client.settings import KafkaSettings

#: A supervised role whose transactional call blocks this long exits and is restarted
#: (``RLSTREAM_HUNG_TRANSACTION_S`` overrides it).
HUNG_TRANSACTION_S = 90.0

#: role -> the module whose ``run_role(ctx)`` runs it.
ROLES = {
    "scheduler": "rlstream.rollout.scheduler",
    "rollout": "rlstream.rollout.worker",
    "judge": "rlstream.envs.judges",
    "admission": "rlstream.consumers.admission",
    "learner": "rlstream.trainer.learner",
    "feedback-rl": "rlstream.consumers.feedback.rl",
    "eval": "rlstream.rollout.evaluator",
}


def start(args: argparse.Namespace) -> int:
    """Run the role ``args.role`` of run ``args.run`` until it stops; returns the exit code."""
    from rlstream.consumers.consumer import RoleContext, Stopper
    from rlstream.ops.run.config import load_run_config
    from rlstream.producers.client.admin import ensure_run_topics

    role = args.role
    if role == "judge" and not args.name:
        raise SystemExit("error: the judge role needs --name (e.g. --name tests)")
    ranks = getattr(args, "ranks", None)
    sets = [*args.set, *([f"learner.ranks={ranks}"] if ranks else [])]
    config = load_run_config(args.config, sets)
    cfg = config.role(role, args.name)
    world = int(getattr(cfg, "ranks", 1))
    if role == "learner" and world > 1 and "WORLD_SIZE" not in os.environ:
        from rlstream.ops.run.ranks import launch

        return launch([sys.executable, "-m", "rlstream", *sys.argv[1:]], world)
    region = args.region or config.regions.trainer
    if role == "rollout":
        cfg = cfg.model_copy(update={"region": region})  # recorded in every sample
    print(
        f"{role}: run {args.run}, config {json.dumps(cfg.model_dump(mode='json'))}",
        file=sys.stderr,
        flush=True,
    )
    regions = config.regions.topology()
    try:
        regions.check(region)
    except ValueError as exc:
        raise SystemExit(f"error: --region: {exc}") from None
    # on a secured local cluster the role connects as its own user (ops.run.acls)
    settings = KafkaSettings.from_env(args.bootstrap) or config.regions.settings(
        region, args.home, user=role
    )
    if getattr(args, "once", False):  # supervised: a hung transaction ends in a restart
        exit_when_hung(float(os.environ.get("RLSTREAM_HUNG_TRANSACTION_S", HUNG_TRANSACTION_S)))
    report = ensure_run_topics(settings, args.run, regions=regions, here=region)
    if report.drift:
        print(f"warning: topic drift {report.drift}", file=sys.stderr)
    ctx = RoleContext(
        settings,
        args.run,
        cfg,
        Stopper().install(),
        member=args.member or "0",
        name=args.name,
        region=region,
        regions=regions,
    )
    result = importlib.import_module(ROLES[role]).run_role(ctx)
    print(f"{role}: stopped, {json.dumps(result)}", file=sys.stderr)
    return 0
