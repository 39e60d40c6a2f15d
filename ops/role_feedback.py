"""Entry point of ``rlstream run feedback-rl``: parse the config first, then import the role.

The role's config is the ``[feedback_rl]`` table of the run recipe (``--config``, default: the
demo recipe) with ``--set feedback_rl.KEY=VALUE`` overrides; the run-wide ``model`` and
``max_staleness`` apply unless the table sets its own (online feedback may tolerate another
staleness budget than rollouts). The resolved config is printed before the role starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

from rlstream.ops.kafka_env import settings_from_args

DEFAULT_RECIPE = Path(__file__).resolve().parent / "recipes" / "demo.toml"
SHARED = ("model", "max_staleness")


def _override(data: dict[str, Any], item: str) -> None:
    """Apply one ``key.sub=value`` override (value parsed as JSON, else kept as text)."""
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


def feedback_config(path: str | None, overrides: list[str]) -> Any:
    """The feedback-rl config of a recipe (see the module docstring for the precedence)."""
    from rlstream.consumers.feedback_rules import FeedbackRLConfig

    data: dict[str, Any] = tomllib.loads(Path(path or DEFAULT_RECIPE).read_text())
    for item in overrides:
        _override(data, item)
    table = dict(data.get("feedback_rl", {}))
    for key in SHARED:
        if key in data:
            table.setdefault(key, data[key])
    return FeedbackRLConfig.model_validate(table)


def feedback_rl(args: argparse.Namespace) -> int:
    """``rlstream run feedback-rl --run RUN``: online groups from editor feedback."""
    from pydantic import ValidationError

    try:
        cfg = feedback_config(args.config, args.set)
    except ValidationError as exc:
        raise SystemExit(f"error: invalid feedback_rl config: {exc}") from None
    print(
        f"feedback-rl: run {args.run}, config {json.dumps(cfg.model_dump(mode='json'))}",
        file=sys.stderr,
        flush=True,
    )
    from rlstream.consumers.consumer import Stopper
    from rlstream.consumers.feedback_rl import run_feedback_rl
    from rlstream.producers.admin import ensure_run_topics

    settings = settings_from_args(args)
    report = ensure_run_topics(settings, args.run)
    if report.drift:
        print(f"warning: topic drift {report.drift}", file=sys.stderr)
    counts = run_feedback_rl(settings, args.run, cfg, Stopper().install(), args.member or "0")
    print(f"feedback-rl: stopped, decisions {json.dumps(counts)}", file=sys.stderr)
    return 0
