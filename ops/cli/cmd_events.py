"""``rlstream run tap`` helpers and ``rlstream dlq``: read streams as people, not programs."""

from __future__ import annotations

import argparse
import json
import sys

from rlstream.ops.run.kafka_env import add_kafka_args, settings_from_args


def register(sub: argparse._SubParsersAction) -> None:
    dlq = sub.add_parser("dlq", help="list a run's dead letters with their reasons")
    dlq.add_argument("--run", required=True, help="run name")
    dlq.add_argument("--json", action="store_true", help="one JSON object per dead letter")
    add_kafka_args(dlq)
    dlq.set_defaults(func=_dlq)


def add_tap_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stream", required=True, help="stream name, e.g. trajectories")
    parser.add_argument("--topic", default=None, help="a topic name instead of --run/--stream")
    parser.add_argument("--follow", action="store_true", help="keep reading new records")
    parser.add_argument("--from-end", action="store_true", help="start at the end, not the start")
    parser.add_argument("--limit", type=int, default=None, help="stop after N records")
    parser.add_argument("--format", choices=["text", "jsonl"], default="text")


def tap_role(args: argparse.Namespace) -> int:
    from rlstream.consumers.tap import jsonable, tap
    from rlstream.schemas import topics

    topic = args.topic or topics.topic_name(args.run, args.stream)
    settings = settings_from_args(args)
    for msg, decoded, error in tap(settings, topic, args.follow, args.from_end, args.limit):
        where = {
            "topic": msg.topic(),
            "partition": msg.partition(),
            "offset": msg.offset(),
            "key": (msg.key() or b"").decode(errors="replace"),
        }
        if args.format == "jsonl":
            body = (
                {"event": decoded.event, "record": jsonable(decoded.record)}
                if decoded
                else {"error": error}
            )
            print(json.dumps({**where, **body}), flush=True)
        else:
            head = f"{where['topic']}[{where['partition']}]@{where['offset']} key={where['key']}"
            if decoded is None:
                print(f"{head} UNDECODABLE {error}", flush=True)
            else:
                print(f"{head} {decoded.event} {jsonable(decoded.record, full=False)}", flush=True)
    return 0


def _dlq(args: argparse.Namespace) -> int:
    from rlstream.consumers.tap import jsonable, tap
    from rlstream.schemas import topics

    count = 0
    for msg, decoded, error in tap(settings_from_args(args), topics.topic_name(args.run, "dlq")):
        count += 1
        if decoded is None:
            print(f"@{msg.offset()} undecodable dead letter: {error}", file=sys.stderr)
            continue
        rec = decoded.record
        if args.json:
            print(json.dumps(jsonable(rec)))
        else:
            print(
                f"{rec['source_topic']}[{rec['partition']}]@{rec['offset']}  {rec['reason']}: "
                f"{rec['error']}  (group {rec['consumer_group'] or '-'}, {len(rec['value'])} bytes)"
            )
    if not args.json:
        print(f"{count} dead letter(s)")
    return 0
