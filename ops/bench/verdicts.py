"""``rlstream bench verdicts``: what the repo family's verdict defences cost per scored answer.

For the first task of each shipped package, its reference patch is scored ``--pairs`` times
with the defences (``envs.patch_policy`` before the run; the judged run: the tests in the
verdict side, the package in the answer's process, every use of it a request over the bridge)
and as many times without them (the baseline: the same tests on the same prepared tree in one
process of the same sandbox, pytest in-process, as an undefended harness runs them: the
driver's ``list`` role), the two arms interleaved in alternating order so drift and load fall
on both. Reported per package: the median time of each arm, the median of the paired
differences with its 95% interval (order statistics of the paired differences), and the
policy check alone. Every test must pass in both arms (the reference patch), so the defences
are timed on work that gets through them. With ``--json`` the last stdout line is one JSON
object; ``--save`` also keeps it in the results folder.
"""

from __future__ import annotations

import argparse
import json
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rlstream.envs import patch_policy, repo, repo_tools, sandbox
    from rlstream.ops.bench.common import median_ci95, progress

    fam = repo.RepoFamily("repo", repo.RepoConfig(eval_fraction=0.0))
    firsts: dict[str, repo.RepoTask] = {}
    for task in fam.loaded.tasks.values():
        firsts.setdefault(task.repo, task)

    def undefended(task: repo.RepoTask) -> bool:
        tree = fam.loaded.trees[task.base]
        files = repo.prepared(task, tree, task.patch)
        assert isinstance(files, dict)
        must = [*task.FAIL_TO_PASS, *task.PASS_TO_PASS]
        program = repo_tools.driver("list", tree.paths, sorted({t.split("::")[0] for t in must}))
        result = sandbox.run(program, repo.box(fam.cfg, args.isolation), files=files)
        outcomes = json.loads((result.stdout.strip().splitlines() or ["[{}]"])[-1])[0]
        return all(outcomes.get(t) == "passed" for t in must)

    packages = {}
    for name, task in firsts.items():
        fam.score_patch(task, task.patch, args.isolation)  # warm: the library, the zygote
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(args.pairs):
            for defended in (True, False) if i % 2 == 0 else (False, True):
                t0 = time.perf_counter()
                ok = fam.score_patch(task, task.patch, args.isolation).passed if defended else (
                    undefended(task))  # fmt: skip
                times[defended].append(time.perf_counter() - t0)
                if not ok:
                    raise RuntimeError(f"{task.instance_id}: reference patch failed ({defended})")
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
            "added_ms_ci95": [round(x, 1) for x in median_ci95(diffs)],
            "policy_check_ms": round(policy_ms, 3),
        }
        progress(f"{name}: {packages[name]}")
    return {"pairs": args.pairs, "isolation": args.isolation, "packages": packages}


def _lines(result: dict[str, Any]) -> list[str]:
    out = [f"verdict defences, {result['pairs']} interleaved pairs per package (reference patch):"]
    for name, p in result["packages"].items():
        lo, hi = p["added_ms_ci95"]
        out.append(
            f"  {name:20} {p['with_defences_ms']:7.1f} ms vs {p['without_ms']:7.1f} ms: "
            f"added {p['added_ms_median']:+.1f} ms (95% {lo:+.1f}..{hi:+.1f}); "
            f"policy check {p['policy_check_ms']:.3f} ms"
        )
    return out
