"""``rlstream bench role-start``: what starting each role costs before it does any work.

For every role ``rlstream run`` starts, a fresh interpreter does what ``rlstream run ROLE`` does
before it first reaches Kafka: it imports the command line and the run config, resolves the
role's config from the default recipe and imports the role's module. Measured per role, over
``--repeat`` fresh processes: the median wall time of those steps and the median peak memory
(resident set, ``ru_maxrss``) of the process, with which heavy libraries it loaded. With
``--code DIR`` the same is measured for another checkout of rlstream (an older commit, say) in
the same run, beside this one, so the two are compared on the same load. With ``--json`` the
last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Libraries whose import dominates a role's start, reported when a role loads them.
HEAVY = ("torch", "transformers", "numba", "vllm", "mlflow", "aiohttp", "matplotlib")

#: Run in the measured process; ``CODE`` (a folder holding an ``rlstream`` link) goes first on
#: the path and the editable install's finder is set aside, so that checkout is the one imported.
PROBE = """
import json, resource, sys, time
CODE, ROLE = sys.argv[1], sys.argv[2]
if CODE:
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
    sys.path.insert(0, CODE)
started = time.perf_counter()
import importlib
importlib.import_module("rlstream.ops.cli")
from rlstream.ops.run.config import load_run_config
from rlstream.ops.run.roles import ROLES
config = load_run_config(None, [])
config.role(ROLE, "tests" if ROLE == "judge" else None)
importlib.import_module(ROLES[ROLE].module)  # as that checkout declares it
seconds = time.perf_counter() - started
import rlstream
print(json.dumps({
    "seconds": seconds,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "loaded": [name for name in sys.argv[3].split(",") if name in sys.modules],
    "from": rlstream.__file__,
}))
"""


def register_bench(bench_subparsers: Any) -> None:
    """Add ``role-start`` to the ``rlstream bench`` subcommands."""
    p = bench_subparsers.add_parser(
        "role-start",
        help="each role's start: import time and peak memory before its first Kafka call",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--repeat", type=int, default=5, help="fresh processes per role and code")
    p.add_argument("--code", help="another rlstream checkout to measure beside this one")
    p.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from rlstream.ops.bench.common import emit

    result = run(args.repeat, args.code)
    lines = [] if args.json else _lines(result)
    emit(result, args.json, lines, None)
    return 0


def _roles() -> list[str]:
    from rlstream.ops.run.roles import ROLES

    return [name for name, role in ROLES.items() if role.serve is None]


def _measure(code: str, role: str, repeat: int) -> dict[str, Any]:
    runs = []
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, "-c", PROBE, code, role, ",".join(HEAVY)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{role} ({code or 'this checkout'}): {out.stderr[-800:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {
        "seconds_median": round(statistics.median(r["seconds"] for r in runs), 3),
        "peak_rss_mib_median": round(statistics.median(r["peak_rss_mib"] for r in runs), 1),
        "loaded": runs[0]["loaded"],
        "from": runs[0]["from"],
    }


def run(repeat: int, other: str | None) -> dict[str, Any]:
    from rlstream.ops.bench.common import progress

    codes = {"this": ""}
    with tempfile.TemporaryDirectory() as tmp:
        if other:
            (Path(tmp) / "rlstream").symlink_to(Path(other).resolve())
            codes["other"] = tmp
        roles: dict[str, dict[str, Any]] = {}
        for role in _roles():
            roles[role] = {}
            for label, code in codes.items():  # alternated per role: load falls on both
                progress(f"role-start: {role} ({label}) x{repeat}")
                roles[role][label] = _measure(code, role, repeat)
    return {"repeat": repeat, "other": other, "roles": roles}


def _lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for role, arms in result["roles"].items():
        for label, m in arms.items():
            heavy = ", ".join(m["loaded"]) or "none"
            lines.append(
                f"{role:12s} {label:5s} {m['seconds_median']:6.2f} s "
                f"{m['peak_rss_mib_median']:7.1f} MiB  heavy: {heavy}"
            )
    return lines
