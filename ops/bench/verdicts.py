"""``rlstream bench verdicts``: what the repo family's verdict defences cost per scored answer.

For the first task of each shipped package, its reference patch is scored ``--pairs`` times
with the defences (``envs.patch_policy`` before the run, the driver's audit hook in the
answer's process) and as many times without them, the two arms interleaved in alternating
order so drift and load fall on both. Reported per package: the median time of each arm, the
median of the paired differences with its 95% interval (order statistics of the paired
differences), and the policy check alone. Every score must pass in both arms (the reference
patch), so the defences are timed on work that gets through them.

The arm without defences replaces ``patch_policy.check`` and wraps the driver program from
outside, as a harness does; nothing in the product reads a switch. With ``--json`` the last
stdout line is one JSON object; ``--save`` also keeps it in the results folder.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any


def register_bench(bench_subparsers: Any) -> None:
    """Add ``verdicts`` to the ``rlstream bench`` subcommands."""
    p = bench_subparsers.add_parser(
        "verdicts",
        help="the repo family's verdict defences: added time per scored answer",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--pairs", type=int, default=20, help="paired runs per package")
    p.add_argument("--isolation", default="full", help="weakest sandbox mode accepted")
    p.add_argument("--json", action="store_true", help="last stdout line is a JSON object")
    p.add_argument("--save", action="store_true", help="keep the result in the results folder")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from rlstream.ops.bench.common import emit

    result = run(args)
    lines = [] if args.json else _lines(result)
    emit(result, args.json, lines, "verdicts" if args.save else None)
    return 0


def _interval(diffs: list[float]) -> list[float]:
    """A 95% interval of the median of ``diffs`` from their order statistics (binomial)."""
    n, ranked = len(diffs), sorted(diffs)
    k = max(0, math.floor(n / 2 - 0.98 * math.sqrt(n)))
    return [ranked[k], ranked[min(n - 1, n - 1 - k)]]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rlstream.envs import patch_policy, repo, repo_tools
    from rlstream.ops.bench.common import progress

    fam = repo.RepoFamily("repo", repo.RepoConfig(eval_fraction=0.0))
    firsts: dict[str, repo.RepoTask] = {}
    for task in fam.loaded.tasks.values():
        firsts.setdefault(task.repo, task)
    driver, check = repo_tools.driver, patch_policy.check

    def arm(defended: bool) -> None:
        repo_tools.driver = (
            driver if defended else (lambda *a: driver(*a).replace("guard=True", "guard=False"))
        )
        patch_policy.check = check if defended else (lambda base, files: [])

    packages = {}
    try:
        for name, task in firsts.items():
            fam.score_patch(task, task.patch, args.isolation)  # warm: the library, the zygote
            times: dict[bool, list[float]] = {True: [], False: []}
            for i in range(args.pairs):
                for defended in (True, False) if i % 2 == 0 else (False, True):
                    arm(defended)
                    t0 = time.perf_counter()
                    verdict = fam.score_patch(task, task.patch, args.isolation)
                    times[defended].append(time.perf_counter() - t0)
                    if not verdict.passed:
                        raise RuntimeError(f"{task.instance_id}: reference patch failed: {verdict}")
            arm(True)
            tree = fam.loaded.trees[task.base]
            base, files = repo.base_files(task, tree), repo.prepared(task, tree, task.patch)
            assert isinstance(files, dict)
            t0 = time.perf_counter()
            for _ in range(args.pairs):
                patch_policy.check(base, files)
            policy_ms = (time.perf_counter() - t0) / args.pairs * 1000
            diffs = [(a - b) * 1000 for a, b in zip(times[True], times[False], strict=True)]
            packages[name] = {
                "with_defences_ms": round(statistics.median(times[True]) * 1000, 1),
                "without_ms": round(statistics.median(times[False]) * 1000, 1),
                "added_ms_median": round(statistics.median(diffs), 1),
                "added_ms_ci95": [round(x, 1) for x in _interval(diffs)],
                "policy_check_ms": round(policy_ms, 2),
            }
            progress(f"{name}: {packages[name]}")
    finally:
        arm(True)
    return {"pairs": args.pairs, "isolation": args.isolation, "packages": packages}


def _lines(result: dict[str, Any]) -> list[str]:
    out = [f"verdict defences, {result['pairs']} interleaved pairs per package (reference patch):"]
    for name, p in result["packages"].items():
        lo, hi = p["added_ms_ci95"]
        out.append(
            f"  {name:20} {p['with_defences_ms']:7.1f} ms vs {p['without_ms']:7.1f} ms: "
            f"added {p['added_ms_median']:+.1f} ms (95% {lo:+.1f}..{hi:+.1f}); "
            f"policy check {p['policy_check_ms']:.2f} ms"
        )
    return out
