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
are timed on work that gets through them. Run as root, a third arm scores the defended path
through the sandbox service (``envs.sandbox.service``: what a role running as its own OS user
pays, ``service_added_ms``, paired against the defended path run here). With ``--json`` the last
stdout line is one JSON object; ``--save`` also keeps it in the results folder.
"""

from __future__ import annotations

import argparse
import json
import os
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
    from rlstream.envs.sandbox import client as sandbox_client
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

    client = sandbox_client.start() if os.geteuid() == 0 else None
    sandbox_client.use(None)  # each arm says where it runs

    def scored(task: repo.RepoTask, arm: str) -> bool:
        if arm == "undefended":
            return undefended(task)
        sandbox_client.use(client if arm == "service" else None)
        try:
            return fam.score_patch(task, task.patch, args.isolation).passed
        finally:
            sandbox_client.use(None)

    arms = ["defended", "undefended", *(["service"] if client else [])]
    packages = {}
    for name, task in firsts.items():
        for arm in arms:  # warm: the library, the zygote, the service's own
            scored(task, arm)
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for i in range(args.pairs):
            for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:  # each arm leads in turn
                t0 = time.perf_counter()
                ok = scored(task, arm)
                times[arm].append(time.perf_counter() - t0)
                if not ok:
                    raise RuntimeError(f"{task.instance_id}: reference patch failed ({arm})")
        tree = fam.loaded.trees[task.base]
        base, files = repo.base_files(task, tree), repo.prepared(task, tree, task.patch)
        assert isinstance(files, dict)
        t0 = time.perf_counter()
        for _ in range(args.pairs):
            patch_policy.check(base, files)
        policy_ms = (time.perf_counter() - t0) / args.pairs * 1000
        diffs = [
            (a - b) * 1000 for a, b in zip(times["defended"], times["undefended"], strict=True)
        ]
        packages[name] = {
            "with_defences_ms": round(statistics.median(times["defended"]) * 1000, 1),
            "without_ms": round(statistics.median(times["undefended"]) * 1000, 1),
            "added_ms_median": round(statistics.median(diffs), 1),
            "added_ms_ci95": [round(x, 1) for x in median_ci95(diffs)],
            "policy_check_ms": round(policy_ms, 3),
        }
        if client is not None:
            via = [(a - b) * 1000 for a, b in zip(times["service"], times["defended"], strict=True)]
            packages[name]["service_added_ms_median"] = round(statistics.median(via), 1)
            packages[name]["service_added_ms_ci95"] = [round(x, 1) for x in median_ci95(via)]
        progress(f"{name}: {packages[name]}")
    if client is not None:
        client.close()
    return {"pairs": args.pairs, "isolation": args.isolation, "packages": packages}


def _lines(result: dict[str, Any]) -> list[str]:
    out = [f"verdict defences, {result['pairs']} interleaved pairs per package (reference patch):"]
    for name, p in result["packages"].items():
        lo, hi = p["added_ms_ci95"]
        out.append(
            f"  {name:20} {p['with_defences_ms']:7.1f} ms vs {p['without_ms']:7.1f} ms: "
            f"added {p['added_ms_median']:+.1f} ms (95% {lo:+.1f}..{hi:+.1f}); "
            f"policy check {p['policy_check_ms']:.3f} ms"
            + (
                f"; through the sandbox service {p['service_added_ms_median']:+.1f} ms"
                if "service_added_ms_median" in p
                else ""
            )
        )
    return out
