"""Simulated editor users for ``rlstream demo --feedback N``: real-time RL beside the rollouts.

Each user, in turn, does what an editor user of the served policy does:

- asks the run's policy server (``rlstream serve policy``, following the run's weights) for
  ``choices`` completions of a training task's prompt, drawn as the scheduler draws its tasks
  (the recipe's families, training split only) from an index range of its own;
- tries each completion as the user would by running it: the task family's own score, in the
  sandbox (``TaskFamily.score``), so a user accepts what works;
- sends one feedback event per completion through the feedback service (``rlstream serve
  feedback``, HMAC-signed with the service's key): ``accepted`` when it passed, else
  ``rejected``, naming only the request id, the choice and the user; the service stores a salted
  hash of the user id, never the id.

feedback-rl then joins each feedback with the served record and admits online groups, which the
learner trains on beside the rollouts' groups; ``summary`` reads back how many were admitted and
trained (named in a version's manifest).

Bounded: a user waits ``pause_s`` between requests; a request or a feedback that fails is
counted (``errors``, with the last reason) and the users go on; ``stop`` ends the loop.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any

from rlstream.ops.run.services import FeedbackProcess, PolicyService, post
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import topics

if TYPE_CHECKING:
    from rlstream.producers.weights.run_keys import RunKeys

TASK_INDEX_BASE = 10_000_000
"""Editor tasks are drawn from indices far above the scheduler's (its ``max_tasks`` at most)."""


class EditorUsers:
    """``users`` simulated editor users (``editor-0`` ...) in one background thread."""

    def __init__(
        self,
        run: str,
        scheduler_cfg: Any,
        policy_url: str,
        feedback_url: str,
        key: bytes,
        *,
        model: str = "policy",
        users: int = 3,
        choices: int = 4,
        max_tokens: int = 48,
        pause_s: float = 1.0,
        key_id: str = "k1",
        policy_auth: dict[str, str] | None = None,
    ) -> None:
        from rlstream.envs import family as families
        from rlstream.rollout.scheduler import with_fx_options

        self.run, self.cfg, self.model = run, scheduler_cfg, model
        specs = with_fx_options(scheduler_cfg.families, scheduler_cfg.tasks)
        self.families = families.families(specs)  # each task scored by its family, built once
        self.policy_url, self.feedback_url = policy_url, feedback_url
        self.policy_auth = policy_auth or {}
        self.key, self.key_id = key, key_id
        self.users = [f"editor-{i}" for i in range(users)]
        self.choices, self.max_tokens, self.pause_s = choices, max_tokens, pause_s
        self.counts = {"requests": 0, "accepted": 0, "rejected": 0, "stored": 0, "errors": 0}
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="editor-users", daemon=True)

    def start(self) -> EditorUsers:
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        index = 0
        while not self._stop.is_set():
            user = self.users[index % len(self.users)]
            try:
                self.session(user, index)
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                self.counts["errors"] += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
            index += 1
            self._stop.wait(self.pause_s)

    def session(self, user: str, index: int) -> None:
        """One request of ``user`` and its feedback (see the module rules)."""
        from rlstream.rollout.scheduler import task_record

        task = task_record(self.run, self.cfg, TASK_INDEX_BASE + index, 0)
        body = {
            "model": self.model,
            "prompt": task["prompt"],
            "max_tokens": self.max_tokens,
            "n": self.choices,
            "user": user,
            "task_class": "editor",
        }
        status, answer = post(
            f"{self.policy_url}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", **self.policy_auth},
            timeout=120,
        )
        if status == 503:
            return  # no version served yet (or its stream is down): the user tries again later
        if status != 200 or answer is None:
            raise RuntimeError(f"completion answered {status}: {answer}")
        self.counts["requests"] += 1
        scorer = self.families[task["family"]]
        events = []
        for choice in answer["choices"]:
            passed = scorer.score(task["task_id"], choice["text"]).passed
            action = "accepted" if passed else "rejected"
            self.counts[action] += 1
            events.append(
                {
                    "feedback_id": f"{answer['request_id']}-{choice['index']}",
                    "request_id": answer["request_id"],
                    "policy_version": int(answer["policy_version"]),
                    "model": self.model,
                    "action": action,
                    "user_id": user,
                    "task_class": "editor",
                    "metadata": {"choice": str(choice["index"])},
                }
            )
        self._send(events)

    def _send(self, events: list[dict[str, Any]]) -> None:
        from rlstream.producers.feedback import auth as fa
        from rlstream.producers.feedback.models import FEEDBACK_PATH

        body = json.dumps({"events": events}).encode()
        target = fa.Target("POST", FEEDBACK_PATH, self.run)
        headers = fa.signed_headers(self.key, self.key_id, target, body)
        status, answer = post(f"{self.feedback_url}{FEEDBACK_PATH}", body, headers, timeout=120)
        if status != 202 or answer is None:
            raise RuntimeError(f"feedback answered {status}: {answer}")
        self.counts["stored"] += int(answer.get("accepted", 0))

    def figures(self) -> dict[str, Any]:
        return {"users": len(self.users), **self.counts, "last_error": self.last_error}


def start(
    run: str,
    settings: KafkaSettings,
    folder: Any,
    recipe: list[str],
    config: Any,
    users: int,
    keys: RunKeys,
) -> tuple[list[Any], EditorUsers]:
    """The run's feedback service (a fresh HMAC key) and policy server, up, and ``users``
    editor users sending to them; returns (services, users) for the caller to stop."""
    key = secrets.token_hex(16).encode()
    feedback = FeedbackProcess(run, settings, folder, key=key, env=keys.env("feedback"))
    policy = PolicyService(run, settings, folder, recipe=tuple(recipe), env=keys.env("policy"))
    services = [feedback, policy]
    for service in services:
        service.start()
    editors = EditorUsers(
        run,
        config.role("scheduler"),
        policy.url,
        feedback.url,
        key,
        model=config.model,
        users=users,
        max_tokens=config.role("rollout").harness.max_new_tokens,
        policy_auth=policy.auth,
    )
    return services, editors.start()


def trained_online_groups(settings: KafkaSettings, run: str) -> dict[str, Any]:
    """How many online groups (from editor feedback) feedback-rl admitted and rejected (and
    why), how many of the admitted ones a published version trained on (its manifest's
    inputs), and which versions those were."""
    from rlstream.consumers.read_to_end import read_topic
    from rlstream.schemas import events

    def records(stream: str) -> list[tuple[dict[str, Any], tuple[str, int, int]]]:
        topic = topics.topic_name(run, stream)
        out = []
        for msg in read_topic(settings, topic, name="demo-online"):
            try:
                rec = events.decode(msg.value() or b"").record
            except events.EventError:
                continue
            out.append((rec, (topic, int(msg.partition() or 0), int(msg.offset() or 0))))
        return out

    online = [where for rec, where in records("admitted") if rec.get("source") == "online"]
    rejected = Counter(
        str(rec.get("reason")) for rec, _ in records("rejected") if rec.get("source") == "online"
    )
    trained = {
        (i["topic"], int(i["partition"]), int(i["offset"])): int(rec["version"])
        for rec, _ in records("weights.manifests")
        for i in rec.get("step_inputs") or []
    }
    versions = sorted({trained[where] for where in online if where in trained})
    return {
        "online_groups_admitted": len(online),
        "online_groups_rejected": sum(rejected.values()),
        "online_rejected_by_reason": dict(rejected),
        "online_groups_trained": sum(1 for where in online if where in trained),
        "online_versions": versions,
    }
