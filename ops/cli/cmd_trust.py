"""``rlstream trust``: this host's weight-key pins, the only trust anchors a reader takes on its own.

A run's creator pins the run on its own host; a user whose roles read a run made elsewhere pins
the run's public key here (from the run's key folder, ``weights-public-key.hex``, or from whoever
made it), or gives it to each role as ``$RLSTREAM_WEIGHTS_VERIFY_KEY``. No record on a topic is
ever taken as a key (``consumers.weights.trust``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trust", help="pin a run's weight-signing public key on this host")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    pin = verbs.add_parser("pin", help="pin RUN to a public key (or to its insecure choice)")
    pin.add_argument("run", help="the run")
    what = pin.add_mutually_exclusive_group(required=True)
    what.add_argument("--key", help="the run's Ed25519 public key in hex")
    what.add_argument("--key-file", help="a file holding it (the run's weights-public-key.hex)")
    what.add_argument(
        "--insecure", action="store_true", help="the run was created insecure: accept unsigned"
    )
    pin.set_defaults(func=_pin)
    show = verbs.add_parser("list", help="the runs pinned on this host")
    show.add_argument("--json", action="store_true", help="one JSON object")
    show.set_defaults(func=_list)
    forget = verbs.add_parser("forget", help="remove RUN's pin")
    forget.add_argument("run", help="the run")
    forget.set_defaults(func=_forget)


def _pin(args: argparse.Namespace) -> int:
    from rlstream.producers.weights.run_keys import RunKeys, pin
    from rlstream.producers.weights.signing import Verifier

    if args.insecure:
        keys = RunKeys(insecure=True)
    else:
        try:
            text = args.key if args.key else Path(args.key_file).read_text()
            keys = RunKeys(text.strip())
            verifier = Verifier.from_hex(text)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        path = pin(args.run, keys)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    said = "INSECURE (unsigned manifests accepted)" if args.insecure else f"key {verifier.key_id}"
    print(f"run {args.run} pinned to {said}: {path}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from rlstream.producers.weights.run_keys import pinned, trust_dir
    from rlstream.producers.weights.signing import Verifier

    found: dict[str, str] = {}
    folder = trust_dir()
    for path in sorted(folder.glob("*.pin")) if folder.is_dir() else []:
        keys = pinned(path.stem)
        if keys.insecure:
            found[path.stem] = "insecure"
        elif keys.verify_hex:
            try:
                found[path.stem] = f"key {Verifier.from_hex(keys.verify_hex).key_id}"
            except ValueError as exc:
                found[path.stem] = f"unusable pin: {exc}"
    if args.json:
        print(json.dumps({"trust_dir": str(folder), "pins": found}))
    else:
        print(f"{len(found)} run(s) pinned in {folder}")
        for run, what in found.items():
            print(f"  {run}: {what}")
    return 0


def _forget(args: argparse.Namespace) -> int:
    from rlstream.producers.weights.run_keys import unpin

    try:
        gone = unpin(args.run)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"run {args.run}: {'pin removed' if gone else 'was not pinned'}")
    return 0
