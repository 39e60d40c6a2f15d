"""``rlstream acl show | apply --run RUN``: each role's least-privilege ACLs (``ops.acls``).

``show`` prints the plan, one grant a line (or ``--json``: per role, its topics, group and
transactional ids); it needs no broker. ``apply`` makes a secured cluster ready for the run, as
``admin``: it creates one SCRAM-SHA-512 user per role (passwords generated once and kept in the
state directory's ``secrets/credentials.json``, mode 0600, never printed), the run's topics and
the cluster topics (roles may not create topics), then the ACLs, in the region ``--region``
names (default the trainer region). On the local cluster (no ``--bootstrap``) it also grants
each secured MirrorMaker 2 link the run's streams on both of its clusters
(``ops.acls.mirror_grants``), whatever ``--region``.

Rules:
- ``apply`` is idempotent: Kafka keeps one copy of an ACL created twice, a user's credential
  is set again to the same password, existing topics are left as they are;
- ``apply`` only adds: a grant no longer in the plan stays until removed by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rlstream.ops.kafka_env import add_kafka_args, settings_from_args
from rlstream.producers.settings import KafkaSettings


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("acl", help="show or apply each role's least-privilege Kafka ACLs")
    asub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = asub.add_parser("show", help="print the ACLs each role gets for a run")
    show.add_argument("--run", required=True, help="run name (topics rl.RUN.*)")
    show.add_argument("--json", action="store_true", help="per role: topics, group, txn ids")
    show.set_defaults(func=_show)
    apply = asub.add_parser("apply", help="create the role users, run topics and ACLs (admin)")
    apply.add_argument("--run", required=True, help="run name (topics rl.RUN.*)")
    add_kafka_args(apply)
    apply.set_defaults(func=_apply)


def _show(args: argparse.Namespace) -> int:
    from rlstream.ops import acls

    try:
        if args.json:
            print(json.dumps(acls.summary(args.run), indent=2))
        else:
            for grant in acls.plan(args.run):
                print(grant)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _apply(args: argparse.Namespace) -> int:
    from confluent_kafka import KafkaException

    from rlstream.ops import cluster

    home = Path(args.home) if args.home else cluster.default_home()
    local = KafkaSettings.from_env(args.bootstrap) is None
    try:
        counts = apply(settings_from_args(args), args.run, home)
        links = cluster.authorize_links(cluster.load(home), args.run) if local else 0
    except (KafkaException, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"run {args.run}: {counts['users']} role users, {counts['topics']} topics checked, "
        f"{counts['acls']} ACLs applied"
        + (f", {links} MirrorMaker 2 ACLs on the local links" if links else "")
        + f"; credentials in {home / 'secrets'}"
    )
    return 0


def apply(admin_settings: Any, run: str, home: Path, timeout: float = 30.0) -> dict[str, int]:
    """Create the role users, the run's topics and every role's ACLs, as ``admin_settings``'s
    principal (a super user); returns how many of each were applied."""
    from rlstream.ops import acls
    from rlstream.ops.cluster import security
    from rlstream.producers.admin import ensure_run_topics

    grants = acls.plan(run)
    security.authorize(admin_settings, home, acls.PRINCIPALS, grants, timeout)
    report = ensure_run_topics(admin_settings, run)  # rl.schemas and rl.runs included
    topics = len(report.created) + len(report.unchanged) + len(report.drift)
    return {"users": len(acls.PRINCIPALS), "topics": topics, "acls": len(grants)}
