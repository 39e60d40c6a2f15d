"""Judge roles: one consumer group per rubric, each writing one reward per sample exactly once.

- ``tests``: runs the sample's answer against the task's hidden tests in the sandbox
  (``tasks.score``): score 1.0 if every output matches, else 0.0;
- ``format``: the format rubric (``tasks.format_check``): 1.0 or 0.0;
- ``llm``: an LLM-as-judge rubric that asks an OpenAI-compatible completions endpoint to grade
  the answer from 0 to 10 and reads the first number of the reply; a reply without a number,
  or an endpoint error, scores 0 with the reason in ``error`` (never a crash, never a guess).

Rewards are produced in the judge's consume-transform-produce transaction (see
``consumers.transactional``), keyed by group id so they land co-partitioned with the
trajectories. Long trajectories arriving in segments are reassembled first.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlstream.consumers.consumer import Record, RoleContext
from rlstream.consumers.transactional import Output, TransactionalLoop
from rlstream.envs import tasks as task_family
from rlstream.schemas import arrays, topics

JUDGE_VERSION = "1"


class JudgeConfig(BaseModel):
    """Config of a judge role."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["tests", "format", "llm"] = Field("tests", description="Which rubric to apply.")
    tasks: task_family.TaskConfig = Field(
        default_factory=task_family.TaskConfig,
        description="Task family config (rebuilds hidden tests).",
    )
    endpoint: str = Field(
        "http://127.0.0.1:8000/v1/completions",
        description="OpenAI-compatible completions URL (llm judge).",
    )
    llm_model: str = Field("policy", description="Model name sent to the endpoint (llm judge).")
    timeout_s: float = Field(30.0, gt=0, description="HTTP timeout per call (llm judge).")
    batch_size: int = Field(16, ge=1, description="Trajectories per transaction.")


def task_of(task_id: str, cfg: task_family.TaskConfig) -> task_family.Task:
    """The task behind an id of the ``fx`` family (``fx-SEED``): hidden tests are rebuilt here."""
    prefix, _, seed = task_id.rpartition("-")
    if prefix != "fx" or not seed.lstrip("-").isdigit():
        raise ValueError(f"task id {task_id!r} is not of the fx family (fx-SEED)")
    return task_family.sample_task(int(seed), cfg)


def judge_tests(trajectory: dict[str, Any], cfg: JudgeConfig) -> dict[str, Any]:
    passed, details = task_family.score(
        task_of(trajectory["task_id"], cfg.tasks), trajectory["completion"]
    )
    reason = str(details.get("reason", "all hidden tests pass"))
    return {
        "score": 1.0 if passed else 0.0,
        "passed": passed,
        "rationale": reason,
        "details": {k: float(v) for k, v in details.items() if isinstance(v, int | float)},
    }


def judge_format(trajectory: dict[str, Any], cfg: JudgeConfig) -> dict[str, Any]:
    ok, why = task_family.format_check(trajectory["completion"])
    return {"score": 1.0 if ok else 0.0, "passed": ok, "rationale": why or "well formed"}


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_grade(text: str) -> float | None:
    """The first number of a grader's reply, clipped to [0, 10] and scaled to [0, 1]."""
    match = _NUMBER.search(text)
    return None if match is None else min(10.0, max(0.0, float(match.group()))) / 10.0


def judge_llm(trajectory: dict[str, Any], cfg: JudgeConfig) -> dict[str, Any]:
    prompt = (
        f"Grade this answer from 0 to 10.\nTask:\n{trajectory.get('prompt', '')}\n"
        f"Answer:\n{trajectory['completion']}\nGrade:"
    )
    body = json.dumps(
        {"model": cfg.llm_model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    ).encode()
    request = urllib.request.Request(cfg.endpoint, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=cfg.timeout_s) as response:
            reply = json.loads(response.read())
        text = reply["choices"][0]["text"]
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as exc:
        return {
            "score": 0.0,
            "passed": False,
            "rationale": "grader unavailable",
            "error": f"{type(exc).__name__}: {exc}",
        }
    grade = parse_grade(text)
    if grade is None:
        return {
            "score": 0.0,
            "passed": False,
            "rationale": f"no grade in reply {text[:80]!r}",
            "error": "unparseable grade",
        }
    return {
        "score": grade,
        "passed": grade >= 0.5,
        "rationale": f"grader said {text[:80]!r}",
        "details": {"served_version": float(reply.get("policy_version", -1))},
    }


RUBRICS = {"tests": judge_tests, "format": judge_format, "llm": judge_llm}


class Judge:
    """Processor of one judge member: trajectories in, rewards out."""

    def __init__(self, run: str, name: str, cfg: JudgeConfig) -> None:
        self.run, self.name, self.cfg = run, name, cfg
        self.rubric = RUBRICS[cfg.kind]
        self.rewards_topic = topics.topic_name(run, "rewards")
        self.segments = arrays.trajectory_reassembler()
        self.latencies_ms: list[float] = []

    def process(self, records: list[Record]) -> list[Output]:
        outputs = []
        for rec in records:
            traj = self.segments.add(rec.value)
            if traj is None:
                continue
            started = time.perf_counter()
            verdict = self.rubric(traj, self.cfg)
            latency = (time.perf_counter() - started) * 1000
            self.latencies_ms.append(latency)
            ref = {
                "topic": rec.message.topic(),
                "partition": rec.message.partition(),
                "offset": rec.message.offset(),
            }
            outputs.append(
                Output(
                    self.rewards_topic,
                    "reward",
                    {
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
                    },
                    traj["group_id"],
                )
            )
        return outputs


def run_role(ctx: RoleContext) -> int:
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
