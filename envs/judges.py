"""Judge roles: one consumer group per rubric, each writing one reward per sample exactly once.

Rubrics, for any task family: ``tests`` (the hidden tests in the sandbox: 1.0 or 0.0),
``format`` (the family's format rubric), ``llm`` (an LLM-as-judge, ``envs.llm_judge``) and
``function`` (a reward function of the user's, by dotted path: ``reward = "pkg.mod:score"``,
sync or async, called as ``score(task, sample)`` with ``task`` = ``{task_id, family, prompt}``
and ``sample`` the whole trajectory record; it returns a float in [0, 1], a ``(score,
rationale)`` pair or a ``Verdict``). A reward function runs in the judge's own process: it is
the user's code and is trusted; the answer it is given is data (run answers in a family's
sandbox, never in a reward function).

Rules a maintainer must keep:
- a training judge refuses held-out tasks: the reward is an error, so admission rejects the
  group; only a config with ``evaluation = true`` scores them;
- a sample it cannot score gets a reward with ``error`` set and score 0, never a guessed grade,
  and the judge stays up;
- every reward records the isolation its code ran under;
- rewards are produced in the consume-transform-produce transaction, keyed by group id;
- memory is bounded (latencies, the reassembler, the verdict memo).

Details: docs/task-families.md (Judges).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from rlstream.consumers.consumer import Record, RoleContext
from rlstream.consumers.transactional import Output, TransactionalLoop
from rlstream.envs import family as families
from rlstream.envs import fx, llm_judge, sandbox
from rlstream.envs import fx_tasks as task_family
from rlstream.envs.family import FamilySpec, Verdict
from rlstream.producers.runtime.metrics import track_buffer
from rlstream.schemas import reassembly, topics

JUDGE_VERSION = "2"
#: Judging latencies kept (the latest), for the role's figures.
LATENCY_WINDOW = 1024


class JudgeConfig(llm_judge.LLMJudgeConfig):
    """Config of a judge role (the ``llm`` fields are used by the llm rubric only)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["tests", "format", "llm", "function"] = Field(
        "tests", description="Which rubric to apply."
    )
    reward: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="`function` judges: the reward function as `module:function`, importable "
        "in the judge's environment (see the module docstring for what it gets and returns).",
    )
    weight: float | None = Field(
        None,
        ge=0,
        le=1000,
        description="This judge's weight in a sample's reward (admission waits for every judge "
        "of the run and sums their weighted scores). None: 1.0 for `tests` and `llm`, 0.1 "
        "for `format`.",
    )
    families: dict[str, FamilySpec] = Field(
        default_factory=lambda: {"fx": FamilySpec()},
        description="The run's task families (injected from the run config).",
    )
    tasks: task_family.TaskConfig = Field(
        default_factory=task_family.TaskConfig,
        description="Options of fx families that give none (the run's shared fx difficulty).",
    )
    isolation: sandbox.Mode = Field(
        "full", description="Weakest sandbox isolation accepted (injected from the run config)."
    )
    batch_size: int = Field(16, ge=1, le=4096, description="Trajectories per transaction.")
    memo_size: int = Field(
        4096, ge=0, le=1_000_000, description="Verdicts remembered by (task id, answer)."
    )
    evaluation: bool = Field(
        False,
        description="Score held-out tasks too (`env score`, evaluation tools). A judge role "
        "trains on what it scores, so it refuses them (an error reward).",
    )

    @model_validator(mode="after")
    def _reward_with_function(self) -> JudgeConfig:
        if (self.kind == "function") != (self.reward is not None):
            raise ValueError(
                "a `function` judge names its `reward` (module:function); no other does"
            )
        return self

    def reward_weight(self) -> float:
        """``weight``, or its default by kind."""
        if self.weight is not None:
            return self.weight
        return 0.1 if self.kind == "format" else 1.0

    def run_families(self) -> dict[str, FamilySpec]:
        return fx.with_fx_options(self.families, self.tasks)


def _reward(v: Verdict) -> dict[str, Any]:
    details = {k: float(x) for k, x in v.details.items()}
    details[f"isolation.{v.isolation}"] = 1.0
    out: dict[str, Any] = {
        "score": v.score,
        "passed": v.passed,
        "rationale": v.rationale[:2000],
        "details": details,
    }
    if v.error is not None:
        out["error"] = v.error[:2000]
    return out


def _unscorable(why: str) -> dict[str, Any]:
    return _reward(Verdict(False, 0.0, why, error=why))


def family_of_sample(trajectory: dict[str, Any], cfg: JudgeConfig) -> families.TaskFamily:
    """The family that scores ``trajectory``; ValueError for a task of no family of the run, and
    for a held-out task unless ``cfg.evaluation`` (a family that tells a task's split says so
    by ``split_of_task``): what a training judge scores is trained on."""
    task_id = trajectory["task_id"]
    fam = families.family_for(cfg.run_families(), task_id)
    split_of_task = getattr(fam, "split_of_task", None)
    if not cfg.evaluation and split_of_task is not None and split_of_task(task_id) == "eval":
        raise ValueError(f"task {task_id!r} is held-out: scored in evaluation only")
    return fam


def judge_tests(trajectory: dict[str, Any], cfg: JudgeConfig) -> dict[str, Any]:
    """The ``tests`` rubric for one trajectory of any family (never raises for the sample)."""
    try:
        fam = family_of_sample(trajectory, cfg)
        return _reward(fam.score(trajectory["task_id"], trajectory["completion"], cfg.isolation))
    except sandbox.IsolationUnavailable as exc:
        return _unscorable(str(exc))
    except ValueError as exc:
        return _unscorable(f"cannot score: {exc}")


def judge_format(trajectory: dict[str, Any], cfg: JudgeConfig) -> dict[str, Any]:
    """The ``format`` rubric of the trajectory's family."""
    try:
        fam = family_of_sample(trajectory, cfg)
        ok, why = fam.format_check(trajectory["task_id"], trajectory["completion"])
    except ValueError as exc:
        return _unscorable(f"cannot check the format: {exc}")
    return _reward(Verdict(ok, 1.0 if ok else 0.0, why or "well formed"))


def judge_llm(trajectory: dict[str, Any], cfg: JudgeConfig) -> dict[str, Any]:
    """The ``llm`` rubric for one trajectory (see ``envs.llm_judge``)."""
    return llm_judge.grade(trajectory, cfg)


@functools.cache
def reward_function(path: str) -> Callable[..., Any]:
    """The function ``module:name`` names; ``ValueError`` saying why when it cannot be had."""
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any import error is theirs to see
        raise ValueError(f"reward {path!r}: cannot import {module_name}: {exc!r}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward {path!r}: {module_name} has no function {name!r}")
    return fn


def judge_function(trajectory: dict[str, Any], cfg: JudgeConfig) -> dict[str, Any]:
    """The ``function`` rubric: the user's reward function on one sample (never raises)."""
    assert cfg.reward is not None
    task_id = str(trajectory["task_id"])
    task = {
        "task_id": task_id,
        "family": families.family_of(task_id),
        "prompt": str(trajectory.get("prompt", "")),
    }
    try:
        result = reward_function(cfg.reward)(task, trajectory)
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        verdict = _as_verdict(result)
    except Exception as exc:  # the user's code: its failure is an error reward, not a crash
        return _unscorable(f"reward {cfg.reward} failed: {type(exc).__name__}: {exc}")
    return _reward(verdict)


async def _awaited(result: Any) -> Any:
    return await result


def _as_verdict(result: Any) -> Verdict:
    if isinstance(result, Verdict):
        return result
    rationale = "reward function"
    if isinstance(result, tuple) and len(result) == 2:
        result, rationale = result
    if isinstance(result, bool) or not isinstance(result, int | float):
        raise TypeError(f"returned {type(result).__name__}, not a float, pair or Verdict")
    score = float(result)
    if not 0.0 <= score <= 1.0:  # NaN fails this too
        raise ValueError(f"returned {score}, outside [0, 1]")
    return Verdict(score >= 0.5, score, str(rationale))


RUBRICS = {
    "tests": judge_tests,
    "format": judge_format,
    "llm": judge_llm,
    "function": judge_function,
}


class Judge:
    """Processor of one judge member: trajectories in, rewards out."""

    def __init__(self, run: str, name: str, cfg: JudgeConfig) -> None:
        if cfg.kind == "llm":
            llm_judge.check_grader(cfg)
        if cfg.reward is not None:
            try:
                reward_function(cfg.reward)
            except ValueError as exc:
                raise SystemExit(f"error: judge {name}: {exc}") from None
        self.run, self.name, self.cfg = run, name, cfg
        self.rubric = RUBRICS[cfg.kind]
        self.rewards_topic = topics.topic_name(run, "rewards")
        self.segments = reassembly.trajectory_reassembler()
        self.latencies_ms: deque[float] = deque(maxlen=LATENCY_WINDOW)  # the latest
        self.memo: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()
        self.pool = ThreadPoolExecutor(cfg.max_concurrency) if cfg.kind == "llm" else None

    def score(self, traj: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """(reward fields, latency ms) for one complete trajectory."""
        started = time.perf_counter()
        key = self._memo_key(traj)
        verdict = self.memo.get(key) if key else None
        if verdict is None:
            verdict = self.rubric(traj, self.cfg)
            if key and "error" not in verdict and "timeout" not in verdict["rationale"]:
                self.memo[key] = verdict
                while len(self.memo) > self.cfg.memo_size:
                    self.memo.popitem(last=False)
        return verdict, (time.perf_counter() - started) * 1000

    def _memo_key(self, traj: dict[str, Any]) -> tuple[str, str] | None:
        if self.cfg.kind != "tests" or not self.cfg.memo_size:
            return None
        try:
            fam = families.family_for(self.cfg.run_families(), traj["task_id"])
        except ValueError:
            return None
        return traj["task_id"], fam.answer(traj["completion"])

    def process(self, records: list[Record]) -> list[Output]:
        done = []
        for rec in records:
            traj = self.segments.add(rec.value)
            if traj is not None:
                done.append((rec, traj))
        if self.pool is not None:
            scored = list(self.pool.map(lambda rt: self.score(rt[1]), done))
        else:
            scored = [self.score(traj) for _, traj in done]
        outputs = [
            self._output(rec, traj, v, ms)
            for (rec, traj), (v, ms) in zip(done, scored, strict=True)
        ]
        self._report()
        return outputs

    def _report(self) -> None:
        track_buffer(f"judge.{self.name}.latencies", len(self.latencies_ms), LATENCY_WINDOW)
        segments = self.segments
        track_buffer(f"judge.{self.name}.segments", segments.pieces, segments.max_pieces)

    def _output(
        self, rec: Record, traj: dict[str, Any], verdict: dict[str, Any], latency: float
    ) -> Output:
        self.latencies_ms.append(latency)
        ref = {
            "topic": rec.message.topic(),
            "partition": rec.message.partition(),
            "offset": rec.message.offset(),
        }
        reward = {
            "run": self.run,
            "group_id": traj["group_id"],
            "task_id": traj["task_id"],
            "sample_index": traj["sample_index"],
            "judge": self.name,
            "judge_version": JUDGE_VERSION,
            "latency_ms": int(latency),
            "policy_version": traj["policy_version"],
            "trajectory": ref,
            "created_ms": int(time.time() * 1000),
            **verdict,
        }
        return Output(self.rewards_topic, "reward", reward, traj["group_id"])


def run_role(ctx: RoleContext[JudgeConfig]) -> int:
    """One judge (``ctx.name``, a rubric) until stopped; returns how many records it judged."""
    run, name, member = ctx.run, str(ctx.name), ctx.member
    judge = Judge(run, name, ctx.cfg)
    group = topics.group_id(run, "judge", name)
    loop = TransactionalLoop(
        ctx.settings,
        group_id=group,
        topics=[ctx.pattern("trajectories")],
        transactional_id=f"{group}.{member}",
        instance_id=f"judge-{name}-{member}",
        dlq_topic=topics.topic_name(run, "dlq"),
        process=judge.process,
        batch_size=ctx.cfg.batch_size,
    )
    return loop.run(ctx.stopper).records
