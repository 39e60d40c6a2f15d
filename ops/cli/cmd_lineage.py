"""``rlstream lineage`` and ``rlstream forget``: what made a version, and a run without a user."""

from __future__ import annotations

import argparse
import json
import sys

from rlstream.ops.run.kafka_env import add_kafka_args, settings_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lineage", help="the records a weight version trained on, or the reverse")
    p.add_argument("--run", required=True, help="the run")
    p.add_argument("--version", type=int, default=None, help="the version (default: the newest)")
    p.add_argument("--since-version", type=int, default=None, help="every version from this one")
    p.add_argument("--sample", default=None, help="TOPIC:PARTITION:OFFSET: versions including it")
    p.add_argument("--source", default=None, help="read MirrorMaker's copy from this region")
    p.add_argument("--json", action="store_true", help="one JSON line per version")
    add_kafka_args(p)
    p.set_defaults(func=_lineage)

    f = sub.add_parser("forget", help="recompute a run without a user's (or a record's) data")
    f.add_argument("--run", required=True, help="the run to forget from")
    f.add_argument("--user-hash", action="append", default=[], help="a user hash (repeatable)")
    f.add_argument("--record", action="append", default=[], help="TOPIC:PARTITION:OFFSET")
    f.add_argument("--json", action="store_true")
    add_kafka_args(f)
    f.set_defaults(func=_forget)


def _lineage(args: argparse.Namespace) -> int:
    from rlstream.ops.forensics.lineage import Lineage, LineageError, parse_position, version_json

    try:
        wanted = parse_position(args.sample) if args.sample else None
        lineage = Lineage(settings_from_args(args), args.run, args.source)
    except (ValueError, LineageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if wanted is not None:
            found = {"run": args.run, "record": wanted, "versions": lineage.versions_with(wanted)}
            print(json.dumps(found) if args.json else f"versions: {found['versions']}")
            return 0
        last = args.version if args.version is not None else max(lineage.manifests, default=0)
        first = args.since_version if args.since_version is not None else last
        for version in range(first, last + 1):
            lineage.check_version(version)
        for version in range(first, last + 1):
            _show(version_json(lineage, version), args.json)
        return 0
    except LineageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        lineage.close()


def _show(found: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(found), flush=True)
        return
    print(f"{found['run']} version {found['version']}: {len(found['samples'])} samples")
    for s in found["samples"]:
        t, task, fb = s["trajectory"], s["task"], s["feedback"]
        rewards = ", ".join(f"{r['judge']}={r['score']:.3g}" for r in s["rewards"])
        who = f" user {fb['user_hash'][:12]} feedback {fb['feedback_id']}" if fb else ""
        print(
            f"  {t['topic']}:{t['partition']}:{t['offset']} v{t['behaviour_version']} "
            f"{t['region']}/{t['worker']}/{t['engine']} task {task['family']}/{task['task_id']} "
            f"[{rewards}]{who}"
        )


def _forget(args: argparse.Namespace) -> int:
    from rlstream.ops.forensics.forget import forget
    from rlstream.ops.forensics.lineage import LineageError, parse_position

    try:
        records = [parse_position(r) for r in args.record]
        result = forget(settings_from_args(args), args.run, args.user_hash, records, log=_stderr)
    except (ValueError, LineageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.as_json()))
    else:
        print(
            f"new run {result.new_run}: {len(result.excluded_records)} records excluded from "
            f"version {result.first_affected_version} on; versions that differ: "
            f"{result.versions_differ}"
        )
    return 0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
