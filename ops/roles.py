"""Entry points of ``rlstream run ROLE``: parse the config first, then import the role.

Each entry point resolves the run config (recipe + ``--set``), prints it, makes sure the run's
topics exist (idempotent), installs SIGTERM/SIGINT handling and runs the role until stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rlstream.ops.kafka_env import settings_from_args


def _setup(args: argparse.Namespace, role: str) -> tuple[Any, Any, Any]:
    from rlstream.consumers.consumer import Stopper
    from rlstream.ops.config import load_run_config
    from rlstream.producers.admin import ensure_run_topics

    config = load_run_config(args.config, args.set)
    role_cfg = config.role(role, getattr(args, "name", None))
    print(
        f"{role}: run {args.run}, config {json.dumps(role_cfg.model_dump(mode='json'))}",
        file=sys.stderr,
        flush=True,
    )
    settings = settings_from_args(args)
    report = ensure_run_topics(settings, args.run)
    if report.drift:
        print(f"warning: topic drift {report.drift}", file=sys.stderr)
    return settings, role_cfg, Stopper().install()


def _member(args: argparse.Namespace) -> str:
    return args.member or "0"


def scheduler(args: argparse.Namespace) -> int:
    from rlstream.rollout.scheduler import run_scheduler

    settings, cfg, stopper = _setup(args, "scheduler")
    run_scheduler(settings, args.run, cfg, stopper)
    return 0


def rollout(args: argparse.Namespace) -> int:
    from rlstream.rollout.worker import run_rollout

    settings, cfg, stopper = _setup(args, "rollout")
    run_rollout(settings, args.run, cfg, stopper, _member(args))
    return 0


def judge(args: argparse.Namespace) -> int:
    from rlstream.envs.judges import run_judge

    if not args.name:
        raise SystemExit("error: the judge role needs --name (e.g. --name tests)")
    settings, cfg, stopper = _setup(args, "judge")
    run_judge(settings, args.run, args.name, cfg, stopper, _member(args))
    return 0


def admission(args: argparse.Namespace) -> int:
    from rlstream.consumers.admission import run_admission

    settings, cfg, stopper = _setup(args, "admission")
    run_admission(settings, args.run, cfg, stopper, _member(args))
    return 0


def learner(args: argparse.Namespace) -> int:
    from rlstream.trainer.learner_role import run_learner

    settings, cfg, stopper = _setup(args, "learner")
    run_learner(settings, args.run, cfg, stopper)
    return 0


def feedback_rl(args: argparse.Namespace) -> int:
    from rlstream.consumers.feedback_rl import run_feedback_rl

    settings, cfg, stopper = _setup(args, "feedback-rl")
    counts = run_feedback_rl(settings, args.run, cfg, stopper, _member(args))
    print(f"feedback-rl: stopped, decisions {json.dumps(counts)}", file=sys.stderr)
    return 0
