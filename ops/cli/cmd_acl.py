"""``rlstream acl show | apply --run RUN``: each principal's least-privilege ACLs
(``ops.run.acls``).

``show`` prints the plan, one grant a line (or ``--json``: per principal, its topics, group and
transactional ids); it needs no broker. ``apply`` makes a secured cluster ready for the run, as
``admin``: in the region ``--region`` names (default the trainer region) it creates one
SCRAM-SHA-512 user per principal that runs there (``acls.roles_in``: every role and service in
the trainer region, rollout workers and judges in a rollout region; passwords generated once and
kept in the state directory, one file per user, ``secrets/users/USER.json``, mode 0600, never
printed), the run's topics, the cluster topics and the MirrorMaker 2 copies the region receives
(roles may not create topics), then their ACLs for that region. On the local cluster (no
``--bootstrap``) it also grants each secured MirrorMaker 2 link the run's streams on both of its
clusters (``ops.run.acls.mirror_grants``), whatever ``--region``.

The run's regions (``--regions trainer,eu``, the trainer region first) decide which copies a
role reads where (``topics.Regions.sources``); by default they are the local cluster's regions
(one region, ``trainer``, when there is none). Apply once per region the run uses.

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

from rlstream.ops.run.kafka_env import add_kafka_args, settings_from_args
from rlstream.producers.client.settings import KafkaSettings


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("acl", help="show or apply each role's least-privilege Kafka ACLs")
    asub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = asub.add_parser("show", help="print the ACLs each role gets for a run")
    show.add_argument("--run", required=True, help="run name (topics rl.RUN.*)")
    show.add_argument("--json", action="store_true", help="per role: topics, group, txn ids")
    show.add_argument("--region", default=None, help="the region (default the trainer region)")
    show.add_argument("--home", default=None, help="local cluster state directory")
    _add_regions_arg(show)
    show.set_defaults(func=_show)
    apply = asub.add_parser("apply", help="create the role users, run topics and ACLs (admin)")
    apply.add_argument("--run", required=True, help="run name (topics rl.RUN.*)")
    _add_regions_arg(apply)
    add_kafka_args(apply)
    apply.set_defaults(func=_apply)


def _add_regions_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--regions",
        default=None,
        help="the run's regions, comma-separated, the trainer region first (default: the "
        "local cluster's regions)",
    )


def topology(args: argparse.Namespace, home: Path) -> Any:
    """The run's ``topics.Regions``: ``--regions``, else the local cluster's, else one region."""
    from rlstream.ops import cluster
    from rlstream.schemas import topics

    names = [r.strip() for r in (args.regions or "").split(",") if r.strip()]
    if names:
        return topics.Regions(names[0], tuple(names[1:]))
    state = cluster.load(home)
    if state.regions:
        return topics.Regions(state.trainer, tuple(state.rollout_regions()))
    return topics.Regions()


def _show(args: argparse.Namespace) -> int:
    from rlstream.ops import cluster
    from rlstream.ops.run import acls

    home = Path(args.home) if args.home else cluster.default_home()
    try:
        regions = topology(args, home)
        if args.json:
            print(json.dumps(acls.summary(args.run, regions, args.region), indent=2))
        else:
            for grant in acls.plan(args.run, None, regions, args.region):
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
        regions = topology(args, home)
        here = regions.check(args.region or regions.trainer)
        counts = apply(settings_from_args(args), args.run, home, regions, here)
        links = cluster.authorize_links(cluster.load(home), args.run) if local else 0
    except (KafkaException, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"run {args.run}, region {here}: {counts['users']} users, {counts['topics']} topics "
        f"checked, {counts['acls']} ACLs applied"
        + (f", {links} MirrorMaker 2 ACLs on the local links" if links else "")
        + f"; credentials in {home / 'secrets' / 'users'} (one file per user)"
    )
    return 0


def apply(
    admin_settings: Any,
    run: str,
    home: Path,
    regions: Any = None,
    here: str | None = None,
    timeout: float = 30.0,
) -> dict[str, int]:
    """In the cluster ``admin_settings`` reaches (a super user's), region ``here`` (default the
    trainer region) of ``regions`` (a ``topics.Regions``, default one region): create the users
    of the principals that run there, the run's topics with the copies the region receives, and
    their ACLs, and in the trainer region the run's weight-signing key (recorded in ``rl.runs``,
    kept in the cluster's secrets for the learner: ``security.weights_key_file``); returns how
    many of each were applied."""
    from rlstream.ops.cluster import security
    from rlstream.ops.run import acls
    from rlstream.producers.client.admin import ensure_run_topics

    regions = regions or acls.SINGLE_REGION
    here = regions.check(here or regions.trainer)
    users = acls.roles_in(regions, here)
    grants = acls.plan(run, users, regions, here)
    security.authorize(admin_settings, home, users, grants, timeout)
    # rl.schemas, rl.runs and the copies included
    report = ensure_run_topics(admin_settings, run, regions=regions, here=here)
    if here == regions.trainer:  # the run's creation: its weight-signing key, in the secrets
        from rlstream.consumers.weights.trust import ensure_run_key

        ensure_run_key(admin_settings, run, security.weights_key_file(home, run))
    topics = len(report.created) + len(report.unchanged) + len(report.drift)
    return {"users": len(users), "topics": topics, "acls": len(grants)}
