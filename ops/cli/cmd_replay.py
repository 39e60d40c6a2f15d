"""``rlstream replay`` and ``rlstream runs``: reproduce, compare and manage runs."""

from __future__ import annotations

import argparse
import json
import sys

from rlstream.ops.run.kafka_env import add_kafka_args, settings_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="reproduce a run bit-exactly, or re-score it with a judge")
    p.add_argument("--run", required=True, help="the recorded run")
    p.add_argument("--to-version", type=int, default=None, help="stop after this version")
    p.add_argument("--judge", default=None, help="re-score the trajectories with this judge ...")
    p.add_argument("--into", default=None, help="... into this run's topics")
    add_kafka_args(p)
    p.set_defaults(func=_replay)

    runs = sub.add_parser("runs", help="list runs (status, versions, topics), or delete one")
    runs.add_argument("action", nargs="?", choices=["list", "delete"], default="list")
    runs.add_argument("run", nargs="?", help="run to delete")
    runs.add_argument("--json", action="store_true")
    add_kafka_args(runs)
    runs.set_defaults(func=_runs)


def _replay(args: argparse.Namespace) -> int:
    from rlstream.ops.forensics.replay import replay, rescore

    settings = settings_from_args(args)
    if args.judge or args.into:
        if not (args.judge and args.into):
            print("error: --judge and --into go together", file=sys.stderr)
            return 2
        rescore(settings, args.run, args.judge, args.into)
        return 0
    result = replay(settings, args.run, args.to_version)
    if result.diverged_at is not None:
        print(f"diverged at version {result.diverged_at}, tensor {result.tensor}: {result.detail}")
        return 1
    print(f"reproduced {result.versions} versions bit-exactly")
    return 0


def _runs(args: argparse.Namespace) -> int:
    from rlstream.consumers.eval_log import read_evals
    from rlstream.consumers.run_log import run_manifests
    from rlstream.consumers.weights.manifest_log import manifests_by_version as weight_manifests

    settings = settings_from_args(args)
    if args.action == "delete":
        return _delete(settings, args.run)
    rows = []
    for name, rec in sorted(run_manifests(settings).items()):
        versions = weight_manifests(settings, name)
        evals = [e for e in read_evals(settings, name) if e["model"] == rec["model"]]
        last = max(evals, key=lambda e: int(e["version"]), default=None)
        released = [int(e["version"]) for e in evals if e["released"]]
        rows.append(
            {
                "run": name,
                "status": rec["status"],
                "versions": max(versions, default=-1),
                "model": rec["model"],
                "code_version": rec["code_version"],
                "topics": rec["topics"],
                "last_eval": None
                if last is None
                else {
                    "version": int(last["version"]),
                    "greedy_success": last["greedy_success"],
                    "pass_at_k": last["pass_at_k"],
                    "k": int(last["k"]),
                    "released": last["released"],
                },
                "released_version": max(released, default=None),
            }
        )
    if args.json:
        print(json.dumps(rows))
    for row in rows if not args.json else []:
        print(
            f"{row['run']:32s} {row['status']:9s} v{row['versions']:<5d} {row['model']:10s} "
            f"{row['code_version']}  ({len(row['topics'])} topics){_eval_text(row)}"
        )
    return 0


def _eval_text(row: dict) -> str:
    last = row["last_eval"]
    if last is None:
        return ""
    return (
        f"  eval v{last['version']}: greedy {last['greedy_success']:.2f} pass@{last['k']} "
        f"{last['pass_at_k']:.2f}, released v{row['released_version']}"
    )


def _delete(settings, run: str | None) -> int:
    from rlstream.producers.client.admin import admin_client, delete_topics
    from rlstream.producers.client.producer import EventProducer
    from rlstream.schemas import topics

    if not run:
        print("error: which run? `rlstream runs delete RUN`", file=sys.stderr)
        return 2
    admin = admin_client(settings)
    names = [t for t in admin.list_topics(timeout=10).topics if _run_of(t) == run]
    delete_topics(admin, names)
    with EventProducer.connect(settings) as producer:
        producer.produce_raw(topics.RUNS_TOPIC, None, run)  # tombstone: the run is gone
    print(f"deleted run {run}: {len(names)} topics")
    return 0


def _run_of(topic: str) -> str | None:
    """The run of a topic of this cluster: its own (``rl.RUN.X``) or a MirrorMaker copy
    (``REGION.rl.RUN.X``), so deleting a run in a rollout region deletes the copies there."""
    from rlstream.schemas import topics

    try:
        return topics.parse_topic(topic).run
    except ValueError:
        return None
