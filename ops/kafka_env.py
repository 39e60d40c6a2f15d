"""Where a command finds Kafka: ``--bootstrap``, else ``RLSTREAM_BOOTSTRAP`` (with the
``RLSTREAM_KAFKA_*`` security settings), else the local cluster's region (``--region``)."""

from __future__ import annotations

import argparse

from rlstream.producers.settings import KafkaSettings


def add_kafka_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("kafka")
    group.add_argument(
        "--bootstrap",
        default=None,
        help="bootstrap servers of an existing cluster (default: $RLSTREAM_BOOTSTRAP, "
        "else the local cluster)",
    )
    group.add_argument(
        "--region", default="trainer", help="local cluster region to use when no bootstrap is given"
    )
    group.add_argument("--home", default=None, help="local cluster state directory")


def settings_from_args(args: argparse.Namespace) -> KafkaSettings:
    settings = KafkaSettings.from_env(getattr(args, "bootstrap", None))
    if settings is not None:
        return settings
    from rlstream.ops import cluster

    state = cluster.load(getattr(args, "home", None))
    region = getattr(args, "region", None) or cluster.DEFAULT_REGION
    if region not in state.running_regions():
        raise SystemExit(
            f"error: no Kafka to talk to: region {region!r} of the local cluster at {state.home} "
            f"is not running. Start it with `rlstream cluster up --regions {region}`, or give "
            f"--bootstrap / RLSTREAM_BOOTSTRAP for an existing cluster."
        )
    return KafkaSettings(bootstrap_servers=state.bootstrap(region))
