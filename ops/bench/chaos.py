"""``rlstream bench chaos``: a demo-sized run while a driver breaks things, and the ledger after.

The demo's recipe, every role its own supervised process, signed weights and a feedback service.
Once version 1 is out, a plan drawn from ``--seed`` kills roles and the broker, injects poison
records and forged manifests, replays signed feedback and runs one round of attacks
(``ops.chaos.attacks``); then the driver waits until every task released is decided.

The run holds only when nothing is lost or trained twice (``groups_lost`` and
``groups_trained_twice`` are 0), the replayed feedback is stored once, and every attack kind was
tried and refused every time; each figure is read from what the roles wrote or logged.

Details: docs/benchmarks.md (bench chaos).
"""

from __future__ import annotations

import argparse
import collections
import random
import re
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rlstream.ops.bench.chaos_report import combine, held, held_off, lines
from rlstream.ops.bench.common import emit, local_cluster, progress
from rlstream.producers.weights.signing import Verifier

HEAP = "768m"
SAME_ROLE_GAP_S = 40.0  # a role killed again sooner could exhaust its supervisor's fast failures
FAULT_GAP_S = 5.0
_RESTART = re.compile(r"supervisor: .+ exited with (-?\d+) after")
_GAVE_UP = re.compile(r"supervisor: .+ giving up")
_REFUSED = re.compile(r"manifests: refusing the record at offset (\d+): (.*)")


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="a run while roles and the broker are killed, poison, ...")
    p.add_argument("--tasks", type=int, default=1000, help="tasks (groups) the scheduler releases")
    p.add_argument("--rollout-workers", type=int, default=2, help="rollout processes")
    p.add_argument("--chaos-seconds", type=float, default=300.0, help="window of the faults")
    p.add_argument("--role-kills", type=int, default=8, help="SIGKILLs of random roles")
    p.add_argument("--broker-kills", type=int, default=1, help="SIGKILLs of the broker")
    p.add_argument("--broker-down", type=float, default=5.0, help="seconds the broker stays down")
    p.add_argument("--poison-rounds", type=int, default=3, help="rounds of poison records")
    p.add_argument("--forged-rounds", type=int, default=2, help="rounds of forged manifests")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault plan")
    p.add_argument(
        "--engine-attack-rounds",
        type=int,
        default=1,
        help="rounds of engine_weights_corrupted after the run (a vLLM engine's weights "
        "corrupted in place: ops.chaos.engine_attack; 0 or no `make vllm`: not tried)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="runs, each a fresh run with its own plan (seeds --seed, --seed+1, ...); the "
        "figures are summed over them, the stalls pooled",
    )
    p.add_argument(
        "--brokers",
        type=int,
        default=1,
        help="brokers of the run's region (3: replicated; adds --failovers rounds of broker "
        "faults: the manifest leader, the learner's transaction coordinator and the active "
        "controller killed, and a rolling restart of every broker)",
    )
    p.add_argument("--failovers", type=int, default=1, help="rounds of broker faults (3 brokers)")
    p.add_argument("--timeout", type=float, default=1500.0, help="most seconds for the run")
    p.add_argument("--run", default=None, help="run name (default chaos-<time>)")
    p.add_argument("--config", default=None, help="TOML recipe (default ops/recipes/demo.toml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=".rlstream/runs", help="where logs go (and the warm start)")
    p.add_argument("--home", default=None, help="local cluster state directory")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C: the roles, the feedback service and a temporary cluster are
    # stopped (by pid) on the way out.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    seeds = [args.seed + i for i in range(max(1, args.seeds))]
    runs = []
    for i, seed in enumerate(seeds):
        args.seed = seed
        if len(seeds) > 1:
            progress(f"seed {seed} ({i + 1} of {len(seeds)})")
        runs.append(run(args, suffix=f"-s{seed}" if len(seeds) > 1 else ""))
    result = combine(runs, seeds)
    brokers = getattr(args, "brokers", 1)
    emit(result, args.json, lines(result), name="chaos" if brokers == 1 else f"chaos-{brokers}b")
    return 0 if held(result) else 1


def run(args: argparse.Namespace, suffix: str = "") -> dict[str, Any]:
    """One run with the plan of ``args.seed`` (named ``--run`` or by the time, plus ``suffix``)."""
    from rlstream.ops.chaos.attacks import attack_families
    from rlstream.ops.run.config import load_run_config
    from rlstream.producers.client.admin import ensure_run_topics

    name = (args.run or time.strftime("chaos-%Y%m%d-%H%M%S")) + suffix
    out = Path(args.out) / name
    (out / "logs").mkdir(parents=True, exist_ok=True)
    sets = [
        *args.set,
        *attack_families(out),
        f"learner.warm_start_cache={Path(args.out) / 'warm-start.pt'}",
        f"learner.state_dir={out / 'learner'}",
        f"scheduler.max_tasks={args.tasks}",
        "regions.trainer=trainer",
        "regions.rollout=[]",
    ]
    config = load_run_config(args.config, sets)
    extra = ["--config", args.config] if args.config else []
    extra += [arg for item in sets for arg in ("--set", item)]
    brokers = getattr(args, "brokers", 1)
    with local_cluster(args, reuse_default=False, heap=_heap(brokers), brokers=brokers) as local:
        home, settings = local.home, local.settings("trainer")
        ensure_run_topics(settings, name)
        driver = Driver(args, name, out, home, settings, config, extra)
        started = time.monotonic()
        driver.run()
        wall = time.monotonic() - started
        result = driver.figures()
        result.update(driver.failover_figures())
        result.update(replayed(settings, name, driver.keys))
    result["wall_seconds"] = round(wall, 1)
    return result


def replayed(settings: Any, run: str, keys: Any) -> dict[str, Any]:
    """The run replayed from its record (``ops.forensics.replay``): each version's weights
    rebuilt from the admitted records its manifest names and checked against its state hash.
    ``replay_reproduced_through``: the last version reproduced bit-exactly; a divergence after a
    learner restart that took the published weights (no checkpoint of that version) is expected
    and named in ``replay_detail``."""
    from rlstream.ops.forensics.replay import replay
    from rlstream.producers.weights.signing import Verifier

    progress("replaying the run from its record ...")  # the forged manifests refused by its key
    found = replay(settings, run, log=lambda _line: None, verifier=Verifier.given(keys))
    through = found.versions if found.diverged_at is None else found.diverged_at - 1
    return {
        "replay_reproduced_through": through,
        "replay_diverged_at": found.diverged_at,
        "replay_detail": found.detail,
    }


class Driver:
    """Starts the run's processes, breaks things by the plan, and reads the figures back."""

    def __init__(
        self,
        args: argparse.Namespace,
        run: str,
        out: Path,
        home: Path,
        settings: Any,
        config: Any,
        extra: list[str],
    ) -> None:
        self.args, self.run_name, self.out, self.home = args, run, out, home
        self.settings, self.config, self.extra = settings, config, extra
        self.logs = out / "logs"
        self.rng = random.Random(args.seed)
        self.roles: list[Any] = []
        self.killed: dict[str, float] = {}  # role -> when it was last killed
        self.kills: list[str] = []
        self.broker_kills = 0
        self.injected: list[Any] = []
        self.forged: list[Any] = []
        self.feedback_replay: dict[str, Any] = {}
        self.attacks: dict[str, Any] = {}  # kind -> ops.chaos.attacks.Attempts, counted at once
        self.attack_records: list[Any] = []  # what the attacks wrote that roles must dead-letter
        self.forged_feedback: list[tuple[str, int, int]] = []
        self.replayed_feedback: tuple[list[Any], list[Any]] = ([], [])  # first, replays
        self.heldout_groups: list[str] = []
        self.forged_groups: dict[str, str] = {}  # verdict forgery kind -> its group
        self.done = False

    # --- the run ----------------------------------------------------------------------------

    def run(self) -> None:
        from rlstream.ops.demo import demo
        from rlstream.ops.run.services import FeedbackProcess, PolicyService
        from rlstream.trainer.learner_step import init_model

        progress(f"run {self.run_name}: logs in {self.logs}")
        progress("warm start (cached) ...")
        init_model(self.config.role("learner"), lambda line: progress(f"  {line}"))
        key_file = demo.learner_key_file(False, self.home, self.run_name, self.out)
        self.keys = demo.sign_weights(self.settings, self.run_name, key_file, False)
        self.key_file = key_file
        self.roles = self._start_roles()
        key = secrets.token_hex(16).encode()
        where = (self.run_name, self.settings, self.logs)
        given = self.keys.env("policy")
        self.feedback = FeedbackProcess(*where, key=key, env=given)
        recipe = tuple(self.extra)
        # serves (and records) completions
        self.policy = PolicyService(*where, recipe=recipe, env=given)
        self.pushed = PolicyService(
            *where, label="policy-push", recipe=recipe, push_token=secrets.token_hex(16), env=given
        )
        services = (self.feedback, self.policy, self.pushed)
        try:
            for service in services:
                service.start()
            self._wait_first_version()
            self._break_things()
            self._wait_done()
            self._settle()
            self._attack_engine()
        finally:
            for service in services:
                service.stop()
            demo.stop_roles(self.roles)

    def _attack_engine(self) -> None:
        """``engine_weights_corrupted``, once the run is done (its vLLM server would slow the
        roles and move the stalls measured during the run)."""
        from rlstream.ops.chaos import engine_attack

        rounds = self.args.engine_attack_rounds
        if not rounds or not engine_attack.available():
            progress("engine_weights_corrupted: not tried (no vLLM build: `make vllm`)")
            return
        progress(f"attacking a vLLM engine's weights in place ({rounds} round(s)) ...")
        attempts = engine_attack.engine_weights_corrupted(self.out / "engine-attack", rounds)
        self.attacks["engine_weights_corrupted"] = attempts
        progress(
            f"  engine_weights_corrupted: {attempts.refused}/{attempts.tried} caught and repaired"
        )

    def _start_roles(self) -> list[Any]:
        from rlstream.ops.demo.demo import start_role

        def start(role: str, name: str = "", *more: str) -> Any:
            extra = [*more, *self.extra]
            where = (self.settings, self.logs, extra, name, "trainer")
            # a call stuck by a broker's restart: the role's own limit (ops.run.roles), unless set
            return start_role(role, self.run_name, *where, env=self.keys.env(role))

        roles = [start("learner"), start("admission"), start("feedback-rl")]
        roles += [start("judge", f"judge-{j}", "--name", j) for j in self.config.judges]
        roles += [
            start("rollout", f"rollout-{i}", "--member", str(i))
            for i in range(self.args.rollout_workers)
        ]
        return [*roles, start("scheduler")]

    def _alive_or_fail(self) -> None:
        dead = [r for r in self.roles if r.proc.poll() is not None and r.name != "scheduler"]
        if dead:
            raise RuntimeError(
                f"role {dead[0].name} exited ({dead[0].proc.returncode}); see {dead[0].log}"
            )

    def _wait_first_version(self) -> None:
        from rlstream.consumers.weights.versions import VersionWatcher
        from rlstream.schemas import topics

        watcher = VersionWatcher(
            self.settings,
            topics.topic_name(self.run_name, "weights.manifests"),
            verifier=Verifier.given(self.keys),
        )
        try:
            deadline = time.monotonic() + self.args.timeout
            scheduler = next(r for r in self.roles if r.name == "scheduler")
            while watcher.version < 1:
                self._alive_or_fail()
                if scheduler.proc.poll() is not None:
                    raise RuntimeError("every task was decided before the learner's version 1")
                if time.monotonic() > deadline:
                    raise TimeoutError("the learner published no version 1")
                time.sleep(1.0)
        finally:
            watcher.close()
        progress("version 1 published: the faults begin")

    def plan(self) -> list[tuple[float, str]]:
        """(seconds after the start of the faults, fault) in time order: each fault at a random
        time in its own slot of the window."""
        a = self.args
        kinds = ["role"] * a.role_kills + ["broker"] * a.broker_kills
        kinds += ["poison"] * a.poison_rounds + ["forge"] * a.forged_rounds
        kinds += ["feedback", "attack"]
        kinds += self._failover_kinds()
        self.rng.shuffle(kinds)
        slot = a.chaos_seconds / len(kinds)
        return [(slot * (i + self.rng.uniform(0.1, 0.9)), k) for i, k in enumerate(kinds)]

    def _break_things(self) -> None:
        started, last = time.monotonic(), 0.0
        for i, (at, kind) in enumerate(self.plan()):
            wait = max(started + at, last + FAULT_GAP_S) - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._alive_or_fail()
            what = getattr(self, f"_fault_{kind}")(i)
            progress(f"[{time.monotonic() - started:5.0f}s] {what}")
            last = time.monotonic()

    def _fault_role(self, i: int) -> str:
        from rlstream.ops.chaos.faults import role_child
        from rlstream.ops.run.services import kill9

        now = time.monotonic()
        able = [
            r
            for r in self.roles
            if r.proc.poll() is None and now - self.killed.get(r.name, -1e9) > SAME_ROLE_GAP_S
        ]
        if not able:
            return "no role to kill now"
        role = self.rng.choice(able)
        child = role_child(role.proc.pid)
        if child is None:
            return f"{role.name} is restarting: not killed"
        kill9(child)
        self.killed[role.name] = now
        self.kills.append(role.name)
        return f"killed {role.name} (pid {child}) with SIGKILL"

    def _fault_broker(self, i: int) -> str:
        from rlstream.ops.chaos.faults import restart_broker

        heap = _heap(getattr(self.args, "brokers", 1))  # node 0 of a replicated region
        restart_broker(self.home, "trainer", heap, self.args.broker_down)
        self.broker_kills += 1
        return f"killed the broker with SIGKILL; restarted after {self.args.broker_down:.0f}s"

    # --- broker faults of a replicated region (ops.chaos.failover) ------------------------------

    def _failover_kinds(self) -> list[str]:
        if getattr(self.args, "brokers", 1) < 3:
            return []
        from rlstream.ops.chaos.failover import KINDS, BrokerFaults

        self.failover = BrokerFaults(self.home, "trainer", self.run_name, _heap(3))
        return [f"failover_{k}" for k in KINDS] * self.args.failovers

    def _fault_failover_leader(self, i: int) -> str:
        return str(self.failover.inject("leader", work_left=self._work_left()))

    def _fault_failover_coordinator(self, i: int) -> str:
        return str(self.failover.inject("coordinator", work_left=self._work_left()))

    def _fault_failover_controller(self, i: int) -> str:
        return str(self.failover.inject("controller", work_left=self._work_left()))

    def _fault_failover_roll(self, i: int) -> str:
        return str(self.failover.inject("roll", work_left=self._work_left()))

    def _work_left(self) -> bool:
        """Tasks are still being decided: the scheduler ends once every task was."""
        scheduler = next(r for r in self.roles if r.name == "scheduler")
        return scheduler.proc.poll() is None

    def failover_figures(self) -> dict[str, Any]:
        brokers = getattr(self.args, "brokers", 1)
        if not hasattr(self, "failover"):
            return {"brokers": brokers}
        return dict(self.failover.figures(self.settings, brokers))

    def _fault_poison(self, i: int) -> str:
        from rlstream.ops.chaos.faults import inject_poison

        landed = inject_poison(self.settings, self.run_name, f"{self.args.seed}-{i}", self.rng)
        self.injected += landed
        return f"injected {len(landed)} poison records ({', '.join(p.kind for p in landed)})"

    def _fault_forge(self, i: int) -> str:
        from rlstream.ops.chaos.faults import attack_weights

        landed = attack_weights(self.settings, self.run_name, self.config.model, self.key_file)
        self.forged += landed
        return f"published {len(landed)} forged manifests ({', '.join(f.kind for f in landed)})"

    def _fault_feedback(self, i: int) -> str:
        from rlstream.ops.chaos.faults import replay_feedback

        self.feedback_replay = replay_feedback(self.feedback, f"{self.run_name}-{i}")
        answers = self.feedback_replay["answers"]
        return f"replayed a signed feedback request: {answers}"

    def _fault_attack(self, i: int) -> str:
        """One round of the attacks other than forged manifests (``ops.chaos.attacks``)."""
        from rlstream.ops.chaos import attacks

        tag = f"{self.args.seed}-{i}"
        pushes = attacks.unauthenticated_policy_push(self.pushed.url)
        self.attacks["unauthenticated_policy_push"] = pushes
        attacks.complete(
            self.policy.url, self.config.model, self.policy.auth
        )  # served: forged feedback names it
        self.forged_feedback = attacks.forged_feedback_tokens(
            self.settings, self.feedback.url, self.run_name, self.feedback.key
        )
        self.replayed_feedback = attacks.feedback_replay(
            self.settings, self.feedback.url, self.run_name, self.feedback.key
        )
        self.attack_records += attacks.unreleased_task(self.settings, self.run_name, tag)
        heldout = attacks.heldout_ids(self.config.run_families())
        self.heldout_groups, landed = attacks.heldout_task(
            self.settings, self.run_name, heldout, tag
        )
        self.attack_records += landed
        self.forged_groups, landed = attacks.verdict_forgeries(
            self.settings, self.run_name, self.config.run_families(), tag
        )
        self.attack_records += landed
        planted = attacks.planted_stdlib_module(self.config.isolation, self.out)
        self.attacks["planted_stdlib_module"] = planted
        return (
            f"attacked: {pushes.tried} policy pushes without the token, "
            f"{len(self.forged_feedback)} forged feedback, "
            f"{len(self.replayed_feedback[1])} replayed feedback, an unreleased task, "
            f"{len(heldout)} held-out tasks, {len(self.forged_groups)} forged verdicts, "
            f"{planted.tried} planted-module answers"
        )

    def _wait_done(self) -> None:
        """Until the scheduler has every task released and decided (it then exits 0)."""
        scheduler = next(r for r in self.roles if r.name == "scheduler")
        deadline = time.monotonic() + self.args.timeout
        while scheduler.proc.poll() is None:
            self._alive_or_fail()
            if time.monotonic() > deadline:
                progress("timed out waiting for every task to be decided")
                return
            time.sleep(2.0)
        self.done = scheduler.proc.returncode == 0
        progress(f"scheduler finished ({scheduler.proc.returncode}): every task decided")

    def _settle(self, timeout: float = 60.0) -> None:
        """Give the roles time to dead-letter the poison and log the refusals."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            letters, refused = self._dead_letters(), self._refusals()
            must = [*self.injected, *self.attack_records]
            missing = [p for p in must if p.dead_letter and _position(p) not in letters]
            unrefused = [f for f in self.forged if f.offset not in refused]
            attacked = self._attack_figures(refused)
            if not missing and not unrefused and all(held_off(a) for a in attacked.values()):
                return
            time.sleep(3.0)

    # --- the figures --------------------------------------------------------------------------

    def _dead_letters(self) -> dict[tuple[str, int, int], list[str]]:
        """Source position -> the reasons of the dead letters written for it."""
        from rlstream.ops.chaos.attacks import dead_letter_positions

        return dead_letter_positions(self.settings, self.run_name)

    def _refusals(self) -> dict[int, list[str]]:
        """Manifest offset -> each refusal a role process logged for it."""
        out: dict[int, list[str]] = collections.defaultdict(list)
        for log in self.logs.glob("*.log"):
            for match in _REFUSED.finditer(log.read_text(errors="replace")):
                out[int(match.group(1))].append(match.group(2))
        return dict(out)

    def _supervisor_lines(self, pattern: re.Pattern[str]) -> int:
        return sum(
            len(pattern.findall(log.read_text(errors="replace"))) for log in self.logs.glob("*.log")
        )

    def _attack_figures(self, refused: dict[int, list[str]]) -> dict[str, dict[str, int]]:
        """Per attack kind ``{"tried", "refused"}``, each refusal read from what the run
        answered, logged or wrote (``ops.chaos.attacks``, ``ops.chaos.faults.attack_tally``)."""
        from rlstream.ops.chaos import attacks
        from rlstream.ops.chaos.faults import attack_tally

        s, run = self.settings, self.run_name
        unreleased = [r for r in self.attack_records if r.kind.startswith("unreleased")]
        return {
            **attack_tally(self.forged, refused),
            **{kind: a.as_dict() for kind, a in self.attacks.items()},
            "forged_feedback_tokens": attacks.feedback_refusals(
                s, run, self.forged_feedback
            ).as_dict(),
            "unreleased_task": attacks.dead_lettered(s, run, unreleased).as_dict(),
            "heldout_task": attacks.judge_refusals(s, run, self.heldout_groups).as_dict(),
            "feedback_replay": attacks.replay_refusals(s, run, *self.replayed_feedback).as_dict(),
            **{
                kind: a.as_dict()
                for kind, a in attacks.verdict_refusals(s, run, self.forged_groups).items()
            },
        }

    def figures(self) -> dict[str, Any]:
        from rlstream.ops.chaos.attacks import ATTACK_PREFIXES
        from rlstream.ops.chaos.faults import POISON_PREFIX
        from rlstream.ops.observe.ledger import read_ledger

        ledger = read_ledger(self.settings, self.run_name).figures(
            foreign=lambda g: g.startswith((POISON_PREFIX, *ATTACK_PREFIXES))
        )
        letters, refused = self._dead_letters(), self._refusals()
        poison = [p for p in self.injected if p.dead_letter]
        reasons = collections.Counter(r for rs in letters.values() for r in rs)
        injected_at = {_position(p) for p in (*self.injected, *self.attack_records)}
        forged_at = {f.offset for f in self.forged}
        return {
            "tasks": self.args.tasks,
            "finished": self.done,
            **{k: v for k, v in ledger.items() if not k.startswith("foreign")},
            "poison_injected": len(self.injected),
            "poison_dead_lettered": sum(1 for p in poison if _position(p) in letters),
            "poison_missed": sum(1 for p in poison if _position(p) not in letters),
            "poison_groups_decided": ledger["foreign_decided"],
            "poison_trained": ledger["foreign_trained"],
            "dead_letters": sum(len(v) for v in letters.values()),
            "dead_letters_by_reason": dict(reasons),
            "dead_letters_of_genuine_records": sum(
                len(v) for k, v in letters.items() if k not in injected_at
            ),
            "dead_letters_of_genuine_records_by_reason": dict(
                collections.Counter(
                    r for k, v in letters.items() if k not in injected_at for r in v
                )
            ),
            "forged_injected": len(self.forged),
            "forged_refused": sum(1 for f in self.forged if f.offset in refused),
            "forged_refusals_logged": sum(len(v) for k, v in refused.items() if k in forged_at),
            "genuine_refused": sum(1 for k in refused if k not in forged_at),
            "role_kills": len(self.kills),
            "role_kills_by_role": dict(collections.Counter(self.kills)),
            "role_restarts": self._supervisor_lines(_RESTART),
            "roles_given_up": self._supervisor_lines(_GAVE_UP),
            "broker_kills": self.broker_kills,
            **self._feedback_figures(),
            "attacks": self._attack_figures(refused),
            **self._success(),
        }

    def _feedback_figures(self) -> dict[str, Any]:
        from rlstream.consumers.read_to_end import read_topic
        from rlstream.schemas import events, topics

        answers = self.feedback_replay.get("answers", {})
        replays = [s for k, v in answers.items() if k != "original" for s in v]
        fid = self.feedback_replay.get("feedback_id")
        topic = topics.topic_name(self.run_name, "feedback")
        stored = sum(
            1
            for msg in read_topic(self.settings, topic, name="chaos-feedback")
            if events.decode(msg.value() or b"").record.get("feedback_id") == fid
        )
        return {
            "feedback_replays": len(replays),
            "feedback_replays_refused": sum(1 for s in replays if 400 <= s < 500),
            "feedback_replays_deduplicated": sum(1 for s in replays if s == 200),
            "feedback_answers": answers,
            "feedback_stored": stored,
        }

    def _success(self) -> dict[str, Any]:
        """The demo's success figures, from the run's rewards (poison left out)."""
        from rlstream.consumers.read_to_end import read_topic
        from rlstream.ops.chaos.faults import POISON_PREFIX
        from rlstream.ops.observe.analytics import RunAnalytics
        from rlstream.schemas import events, topics

        analytics = RunAnalytics(self.run_name)
        topic = topics.topic_name(self.run_name, "rewards")
        for msg in read_topic(self.settings, topic, name="chaos-rewards"):
            try:
                decoded = events.decode(msg.value() or b"")
            except events.EventError:
                continue
            rec = decoded.record
            if decoded.event == "reward" and not str(rec["group_id"]).startswith(POISON_PREFIX):
                analytics.take(str(msg.topic()), rec, msg.timestamp()[1])
        final = analytics.final_versions()
        return {
            "warm_start_success": round(analytics.rate([0]), 3),
            "final_success": round(analytics.rate(final), 3),
            "final_versions": [min(final), max(final)] if final else [],
            "newest_behaviour_version": max(analytics.success, default=-1),
        }


def _heap(brokers: int) -> str:
    """Each broker's heap: ``HEAP`` alone, the replicated default beside the run's roles."""
    from rlstream.ops.cluster.broker import default_heap

    return HEAP if brokers == 1 else default_heap(brokers)


def _position(p: Any) -> tuple[str, int, int]:
    return (p.topic, p.partition, p.offset)
