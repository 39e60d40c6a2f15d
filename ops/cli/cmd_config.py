"""``rlstream config show|validate|docs``: a run's config before anything starts.

``validate RECIPE`` resolves a recipe (a file, or a shipped recipe by name) with ``--set`` values
and says whether it makes a run config: one ``key: message`` line per problem and exit status 2
when it does not, no traceback. ``show`` prints every key of the resolved config, its value and
where the value came from (``recipe``, ``--set`` or ``default``; keys marked ``local`` may differ
between the run's processes and are left out of its hash). ``docs`` writes the reference of every
key (``docs/config-reference.md``), generated from the config models.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("config", help="show, validate or document a run's config")
    csub = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    for name, text in (
        ("validate", "check a recipe: one `key: message` line per problem, exit status 2"),
        ("show", "the resolved config: every key, its value and where it came from"),
    ):
        p = csub.add_parser(name, help=text)
        p.add_argument(
            "recipe",
            nargs="?",
            default=None,
            help="a recipe file, or a shipped recipe by name (default: the demo recipe)",
        )
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
        if name == "show":
            p.add_argument("--json", action="store_true", help="one JSON object instead")
        p.set_defaults(func=_validate if name == "validate" else _show)
    p = csub.add_parser("docs", help="write the reference of every config key (Markdown)")
    p.add_argument("--out", default="-", help="file to write (default: standard output)")
    p.set_defaults(func=_docs)


def _load(args: argparse.Namespace):
    from rlstream.ops.run.config import find_recipe, load_run_config, recipe_data

    path = find_recipe(args.recipe) if args.recipe else None
    config = load_run_config(path, args.set)
    _, sources = recipe_data(path, args.set)
    return path, config, sources


def _validate(args: argparse.Namespace) -> int:
    from rlstream.ops.run.recorded import config_hash

    path, config, sources = _load(args)
    given = sum(1 for s in sources.values() if s == "--set")
    print(
        f"{path or 'the demo recipe'}: valid; config {config_hash(config)} "
        f"({len(sources) - given} keys from the recipe, {given} from --set)"
    )
    return 0


def _show(args: argparse.Namespace) -> int:
    from rlstream.ops.run.config_docs import resolved_rows
    from rlstream.ops.run.recorded import config_hash

    path, config, sources = _load(args)
    rows = resolved_rows(config, sources)
    digest = config_hash(config)
    if args.json:
        print(json.dumps({"recipe": path, "config_hash": digest, "keys": rows}))
        return 0
    print(f"# {path or 'the demo recipe'}, config {digest}")
    width = max(len(r["key"]) for r in rows)
    for r in rows:
        tag = r["source"] + (", local" if r["local"] else "")
        print(f"{r['key']:<{width}} = {json.dumps(r['value'])}  # {tag}")
    return 0


def _docs(args: argparse.Namespace) -> int:
    from rlstream.ops.run.config_docs import reference

    text = reference()
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as out:
            out.write(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
