"""The eval role: scores policy versions on the held-out tasks and decides which are released.

It evaluates version 0 and every ``every``-th version after it, in order, on the run's held-out
tasks (disjoint from training tasks), with the rollout code and each family's own scoring, and
writes one ``eval`` event per (version, task set) to ``rl.RUN.evals``. Figures: greedy success,
pass@k (the unbiased estimator), sample success; an unscorable answer counts as a failure.

Release rule (``release``): a version is released when its held-out greedy success is at least
the last released version's minus ``release_margin``; the first evaluation is released.

Exactly once per (version, task set), restart-safe: one transactional id per run, the evals
stream read back after fencing, one transaction per event after its evaluation. Versions are
never skipped, except one the subscriber refused, which is recorded in ``skipped``.

Details: docs/evaluation.md (The eval role).
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch

from rlstream.consumers.consumer import RoleContext
from rlstream.consumers.eval_log import read_evals
from rlstream.consumers.weights.subscriber import Snapshot, WeightSubscriber
from rlstream.envs import family as families
from rlstream.envs import sandbox
from rlstream.envs.family import FamilySpec, FamilyTask
from rlstream.envs.fx import with_fx_options
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.producers.weights.signing import Verifier
from rlstream.rollout.config import EvalConfig
from rlstream.rollout.harness import Rollout
from rlstream.rollout.model import PolicyModel, build_policy, generate
from rlstream.schemas import topics
from rlstream.schemas.deltacodec import to_torch
from rlstream.schemas.derive import derive

# --- the rules (pure) ----------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` pass: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def next_due(done: Iterable[int], every: int) -> int:
    """The first version to evaluate: the smallest multiple of ``every`` (0 included) not done."""
    have = set(done)
    version = 0
    while version in have:
        version += every
    return version


@dataclass(frozen=True)
class Baseline:
    """The last released version of a task set and its held-out greedy success."""

    version: int
    greedy_success: float


def release(greedy: float, baseline: Baseline | None, margin: float) -> tuple[bool, str]:
    """(released, the rule in words): not worse than the last released version by more than
    ``margin`` on held-out greedy success; the first evaluated version is released."""
    if baseline is None:
        return True, "first evaluation: released"
    floor = baseline.greedy_success - margin
    rule = (
        f"greedy_success {greedy:.4f} >= v{baseline.version} {baseline.greedy_success:.4f} "
        f"- {margin:g}"
    )
    return greedy >= floor - 1e-12, rule if greedy >= floor - 1e-12 else "not " + rule


def held_out_set(cfg: EvalConfig) -> list[FamilyTask]:
    """The held-out tasks of the run: ``eval_tasks`` split over the families by weight (at
    least one each), each family's fixed ``eval_tasks``."""
    specs = with_fx_options(cfg.families, cfg.tasks)
    built = families.families(specs)
    total = sum(s.weight for s in specs.values())
    out: list[FamilyTask] = []
    for name in sorted(specs):
        n = max(1, round(cfg.eval_tasks * specs[name].weight / total))
        out += built[name].eval_tasks(n)
    return out


def task_set_id(held: list[FamilyTask]) -> str:
    """``heldout-N-HASH``: the size and a hash of the task ids and prompts, so figures of
    different sets are never compared or taken for each other."""
    digest = hashlib.sha256()
    for task in held:
        digest.update(f"{task.task_id}\n{task.prompt}\n".encode())
    return f"heldout-{len(held)}-{digest.hexdigest()[:12]}"


@dataclass
class EvalLedger:
    """What the evals stream says about one (model, task set): versions done, last released."""

    done: set[int] = field(default_factory=set)
    baseline: Baseline | None = None
    skipped: dict[int, str] = field(default_factory=dict)  # refused versions: why not evaluated

    def add(self, rec: dict[str, Any]) -> None:
        version = int(rec["version"])
        self.done.add(version)
        if rec["released"] and (self.baseline is None or version >= self.baseline.version):
            self.baseline = Baseline(version, float(rec["greedy_success"]))


def read_ledger(settings: KafkaSettings, run: str, model: str, task_set: str) -> EvalLedger:
    """The ledger of ``task_set`` from the evals stream, read to its end (committed only)."""
    ledger = EvalLedger()
    for rec in read_evals(settings, run):
        if rec["model"] == model and rec["task_set"] == task_set:
            ledger.add(rec)
    return ledger


class Follower(Protocol):
    """What the role needs of a ``WeightSubscriber``."""

    ceiling: int | None

    def wait_for(self, version: int, timeout: float = 30.0) -> Snapshot | None: ...

    def refusal_of(self, version: int) -> str | None: ...


def due_snapshot(
    sub: Follower, ledger: EvalLedger, target: int, timeout: float = 1.0
) -> Snapshot | None:
    """The state of ``target`` once ``sub`` serves it (waiting up to ``timeout``), else None.

    Rule: the subscriber is capped at ``target``; a target it refused is recorded in
    ``ledger.skipped`` with the reason, so ``next_due`` passes over it."""
    sub.ceiling = target
    snap = sub.wait_for(target, timeout=timeout)
    if snap is not None and snap.version == target:
        return snap
    why = sub.refusal_of(target)
    if why is not None:
        ledger.skipped[target] = why
    return None


# --- evaluation ----------------------------------------------------------------------------


@dataclass
class Figures:
    greedy_success: float
    pass_at_k: float
    sample_success: float
    by_family: dict[str, float]
    errors: int


def evaluate(model: PolicyModel, held: list[FamilyTask], cfg: EvalConfig, version: int) -> Figures:
    """Score ``model`` on ``held`` (see the module docstring for the figures)."""
    specs = with_fx_options(cfg.families, cfg.tasks)
    sampled = Rollout(model, derive(cfg.harness, temperature=1.0))
    greedy = Rollout(model, cfg.harness, generate_fn=partial(generate, greedy=True))
    answers: list[tuple[FamilyTask, list[str]]] = []
    for task in held:
        env = families.load_plugin(str(task.spec.get("plugin") or "fx")).environment(task.spec)
        seed = zlib.crc32(f"{cfg.seed}/{version}/{task.task_id}".encode())
        gen = torch.Generator().manual_seed(seed)
        first = greedy.group(task.prompt, 1, gen, env)[0].completion
        rest = [s.completion for s in sampled.group(task.prompt, cfg.k, gen, env)]
        answers.append((task, [first, *rest]))
    score = _scorer(specs, cfg)
    flat = [(t, a) for t, group in answers for a in group]
    with ThreadPoolExecutor(cfg.score_jobs) as pool:
        verdicts = list(pool.map(lambda ta: score(*ta), flat))
    per_task = [verdicts[i * (cfg.k + 1) : (i + 1) * (cfg.k + 1)] for i in range(len(held))]
    n = max(1, len(held))
    by_family: dict[str, list[float]] = {}
    for task, v in zip(held, per_task, strict=True):
        by_family.setdefault(families.family_of(task.task_id), []).append(float(v[0][0]))
    return Figures(
        greedy_success=sum(v[0][0] for v in per_task) / n,
        pass_at_k=sum(pass_at_k(cfg.k, sum(p for p, _ in v[1:]), cfg.k) for v in per_task) / n,
        sample_success=sum(p for v in per_task for p, _ in v[1:]) / max(1, n * cfg.k),
        by_family={k: sum(x) / len(x) for k, x in by_family.items()},
        errors=sum(e for v in per_task for _, e in v),
    )


def _scorer(
    specs: dict[str, FamilySpec], cfg: EvalConfig
) -> Callable[[FamilyTask, str], tuple[bool, bool]]:
    """(passed, error) of one answer; equal answers of a task are scored once."""
    memo: dict[tuple[str, str], tuple[bool, bool]] = {}

    def score(task: FamilyTask, completion: str) -> tuple[bool, bool]:
        fam = families.family_for(specs, task.task_id)
        key = (task.task_id, fam.answer(completion))
        if key not in memo:
            try:
                verdict = fam.score(task.task_id, completion, cfg.isolation)
                memo[key] = (verdict.passed and verdict.error is None, verdict.error is not None)
            except sandbox.IsolationUnavailable:
                memo[key] = (False, True)
        return memo[key]

    return score


# --- the role ------------------------------------------------------------------------------


def eval_record(
    run: str, cfg: EvalConfig, version: int, task_set: str, n_tasks: int, figures: Figures,
    decision: tuple[bool, str], baseline: Baseline | None, started: float,
) -> dict[str, Any]:  # fmt: skip
    return {
        "run": run,
        "model": cfg.model,
        "version": version,
        "task_set": task_set,
        "n_tasks": n_tasks,
        "k": cfg.k,
        "greedy_success": figures.greedy_success,
        "pass_at_k": figures.pass_at_k,
        "sample_success": figures.sample_success,
        "by_family": figures.by_family,
        "errors": figures.errors,
        "released": decision[0],
        "release_rule": decision[1],
        "baseline_version": None if baseline is None else baseline.version,
        "baseline_greedy_success": None if baseline is None else baseline.greedy_success,
        "evaluated_ms": int(time.time() * 1000),
        "duration_ms": int((time.monotonic() - started) * 1000),
        "evaluator": f"{socket.gethostname()}:{os.getpid()}",
    }


def run_role(ctx: RoleContext[EvalConfig]) -> int:
    """Evaluate due versions in order until stopped (or past ``max_version``); returns how
    many this process evaluated."""
    cfg: EvalConfig = ctx.cfg
    run, log = ctx.run, ctx.log
    torch.set_num_threads(cfg.torch_threads)
    held = held_out_set(cfg)
    task_set = task_set_id(held)
    topic = topics.topic_name(run, "evals")
    # fence a predecessor (its open transaction is aborted) before reading back what it did
    producer = EventProducer.transactional(ctx.settings, topics.group_id(run, "eval"))
    ledger = read_ledger(ctx.settings, run, cfg.model, task_set)
    source = ctx.regions.sources("weights.manifests", ctx.region)[0]
    sub = WeightSubscriber(
        ctx.settings, run, cfg.model, source=source, verifier=Verifier.given(ctx.keys)
    )
    model = build_policy(cfg.policy)
    model.eval()
    log(f"eval: task set {task_set}; versions done {sorted(ledger.done)}")
    count = 0
    try:
        while not ctx.stopper.stopped:
            target = next_due(ledger.done | ledger.skipped.keys(), cfg.every)
            if cfg.max_version is not None and target > cfg.max_version:
                break
            snap = due_snapshot(sub, ledger, target)
            if snap is None:
                if target in ledger.skipped:
                    log(f"eval: v{target} not evaluated, refused: {ledger.skipped[target]}")
                continue
            started = time.monotonic()
            with torch.no_grad():
                model.load_state_dict(to_torch(snap.state))
            figures = evaluate(model, held, cfg, target)
            decision = release(figures.greedy_success, ledger.baseline, cfg.release_margin)
            rec = eval_record(
                run, cfg, target, task_set, len(held), figures, decision, ledger.baseline, started
            )
            with producer.transaction():
                producer.produce(topic, "eval", rec, topics.record_key("evals", rec))
            ledger.add(rec)
            count += 1
            log(
                f"eval: v{target} greedy {figures.greedy_success:.3f} pass@{cfg.k} "
                f"{figures.pass_at_k:.3f} sample {figures.sample_success:.3f} "
                f"{'released' if decision[0] else 'held back'} ({decision[1]})"
            )
    finally:
        sub.close()
        producer.close()
    return count
