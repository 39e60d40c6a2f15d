"""Where a command finds Kafka: ``--bootstrap``, else ``RLSTREAM_BOOTSTRAP`` (with the
``RLSTREAM_KAFKA_*`` security settings), else the local cluster's region (``--region``)."""

from __future__ import annotations

import argparse

from rlstream.producers.client.settings import KafkaSettings


def add_kafka_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("kafka")
    group.add_argument(
        "--bootstrap",
        default=None,
        help="bootstrap servers of an existing cluster (default: $RLSTREAM_BOOTSTRAP, "
        "else the local cluster)",
    )
    group.add_argument(
        "--region",
        default=None,
        help="the region to talk to (a role: the region it runs in); its cluster is the local "
        "cluster's region unless a bootstrap is given (default: the trainer region)",
    )
    group.add_argument("--home", default=None, help="local cluster state directory")


def settings_from_args(args: argparse.Namespace) -> KafkaSettings:
    settings = KafkaSettings.from_env(getattr(args, "bootstrap", None))
    if settings is not None:
        return settings
    from rlstream.ops import cluster
    from rlstream.ops.run.regions import local_settings

    region = getattr(args, "region", None) or cluster.DEFAULT_REGION
    return local_settings(region, getattr(args, "home", None))
