"""The suite's time per tier and its skips, from the junit reports of ``make test``.

``python tests/tiers.py build/junit-fast.xml build/junit-system.xml`` prints one row per report
(its tier, tests, failures, skips, its wall time and its budget), warns on stderr when a tier
took longer than its budget, and exits 1 when a test was skipped for a reason outside
``ALLOWED_SKIPS`` (a vLLM test skipped because the engine is missing is a failure of the set-up,
not a pass). ``--markdown`` prints the table for ``docs/testing.md``.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

#: Wall-clock budget per tier on 2 cores, seconds (the fast tier's is the goal of issue-sized
#: changes: run it before every commit).
BUDGETS = {"fast": 300.0, "system": 1500.0}
#: Skips that are expected, with why: anything else fails the run.
ALLOWED_SKIPS = {
    r"CUDA": "the GPU tests: CI has no GPU",
    r"needs root": "roles as their own OS users, where the suite does not run as root",
    r"RLSTREAM_SECURE": "tests that need a plaintext broker, when the suite runs secured",
    r"RLSTREAM_BOOTSTRAP|needs the local launcher": "tests that start their own brokers, when "
    "the suite runs against an external cluster",
}


def read(path: Path) -> dict:
    """One report's figures: tests, failures, skips (node id, reason), wall seconds."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        raise ValueError(f"{path}: no testsuite")
    skips = []
    for case in suite.iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            name = f"{case.get('classname')}::{case.get('name')}"
            skips.append((name, skipped.get("message") or ""))
    return {
        "tier": path.stem.removeprefix("junit-"),
        "tests": int(suite.get("tests", 0)),
        "failures": int(suite.get("failures", 0)) + int(suite.get("errors", 0)),
        "skips": skips,
        "wall_s": float(suite.get("time", 0.0)),
    }


def unexpected(skips: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(n, why) for n, why in skips if not any(re.search(p, why) for p in ALLOWED_SKIPS)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path)
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    rows = [read(r) for r in args.reports if r.exists()]
    if args.markdown:
        print("| tier | tests | wall | budget |\n|---|---:|---:|---:|")
    for r in rows:
        budget = BUDGETS.get(r["tier"])
        b = f"{budget / 60:.0f} min" if budget else "-"
        if args.markdown:
            print(f"| {r['tier']} | {r['tests']} | {r['wall_s'] / 60:.1f} min | {b} |")
        else:
            print(f"{r['tier']:8} {r['tests']:5} tests {r['failures']} failed "
                  f"{len(r['skips'])} skipped {r['wall_s']:7.1f} s (budget {b})")  # fmt: skip
        if budget and r["wall_s"] > budget:
            print(f"warning: the {r['tier']} tier took {r['wall_s']:.0f} s, over its budget of "
                  f"{budget:.0f} s", file=sys.stderr)  # fmt: skip
    bad = [s for r in rows for s in unexpected(r["skips"])]
    for name, why in bad:
        print(f"error: {name} was skipped ({why}): not an allowed skip", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
