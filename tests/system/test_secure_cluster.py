"""A secured broker enforces the role plan: who cannot connect, what each role may and may not do.

The module starts its own secured broker (``cluster.up(secure=True)``) in a temporary state
directory, applies the ACLs of one run as ``admin`` (``rlstream acl apply``), then connects as
each role's user; the last test runs the role loops themselves, each an ``rlstream run`` process
connecting as its own user. It stops exactly that broker and those processes, by pid.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic
from helpers import decode_all, first_record
from pydantic import SecretStr

from rlstream.consumers.consumer import make_consumer
from rlstream.consumers.feedback.seen import FeedbackIdLog
from rlstream.consumers.read_to_end import read_to_end, reader
from rlstream.envs.sandbox.zygote import default_python
from rlstream.ops import cluster
from rlstream.ops.cli.cmd_acl import apply
from rlstream.ops.cli.cmd_serve import FEEDBACK_USER, POLICY_USER, service_settings
from rlstream.ops.cluster import security
from rlstream.ops.demo.demo import RoleProcess, start_role, stop_roles
from rlstream.ops.run import acls, os_users
from rlstream.ops.run.regions import local_settings
from rlstream.producers.client.admin import ensure_run_topics
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import topics

pytestmark = pytest.mark.timeout(240)

QUIET = {"log_level": 0}


@dataclass
class Secured:
    state: cluster.Cluster
    run: str

    def user(self, name: str, password: str | None = None) -> KafkaSettings:
        settings = self.state.settings(user=name)
        if password is not None:
            settings = settings.model_copy(update={"sasl_password": SecretStr(password)})
        return settings

    def topic(self, stream: str) -> str:
        return topics.topic_name(self.run, stream)


@pytest.fixture(scope="module")
def secured() -> Iterator[Secured]:
    if KafkaSettings.from_env() is not None:
        pytest.skip("needs the local launcher to start a secured broker")
    with tempfile.TemporaryDirectory(prefix="rlstream-secure-") as tmp:
        home = Path(tmp) / "cluster"
        try:
            state = cluster.up(["trainer"], home=home, heap="512m", secure=True, log=_quiet)
            run = f"sec{uuid.uuid4().hex[:8]}"
            apply(state.settings(), run, home)
            yield Secured(state, run)
        finally:
            cluster.down(home=home, purge=True, log=_quiet)


def _quiet(*_: object) -> None:
    pass


def _produce(settings: KafkaSettings, topic: str, n: int = 1) -> list[KafkaError | None]:
    """Produce ``n`` records to ``topic`` without a transaction; the delivery error of each."""
    errors: list[KafkaError | None] = []
    producer = Producer({**settings.librdkafka(), **QUIET, "message.timeout.ms": "10000"})
    for i in range(n):
        producer.produce(topic, b"v%d" % i, on_delivery=lambda err, _msg: errors.append(err))
    producer.flush(15)
    return errors


def _write_errors(settings: KafkaSettings, names: list[str]) -> dict[str, KafkaError | None]:
    """Produce one record to each topic of ``names``; the delivery error of each, by topic."""
    errors: dict[str, KafkaError | None] = {}

    def report(err: KafkaError | None, msg: Message) -> None:
        errors[str(msg.topic())] = err

    producer = Producer({**settings.librdkafka(), **QUIET, "message.timeout.ms": "15000"})
    for name in names:
        producer.produce(name, b"x", on_delivery=report)
    producer.flush(20)
    return errors


def _refused(settings: KafkaSettings) -> bool:
    admin = AdminClient({**settings.librdkafka(), **QUIET})
    try:
        admin.list_topics(timeout=5)
    except KafkaException:
        return True
    return False


def test_secrets_are_private(secured: Secured) -> None:
    home = secured.state.home
    for path in [security.secrets_dir(home), *security.secrets_dir(home).iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
    props = secured.state.regions["trainer"].properties
    assert stat.S_IMODE(props.stat().st_mode) == 0o600
    assert set(security.credentials(home)) == {"admin", *acls.PRINCIPALS}


def test_unauthenticated_and_wrong_password_are_refused(secured: Secured) -> None:
    bootstrap = secured.state.bootstrap()
    assert _refused(KafkaSettings(bootstrap_servers=bootstrap))  # no TLS, no SASL
    tls_only = KafkaSettings(
        bootstrap_servers=bootstrap,
        security_protocol="SSL",
        ssl_ca_location=str(security.ca_file(secured.state.home)),
    )
    assert _refused(tls_only)  # TLS without SASL
    assert _refused(secured.user("learner", password="not-the-password"))
    assert _refused(secured.user("admin", password="not-the-password"))
    assert not _refused(secured.user("learner"))


def test_a_role_starts_as_rlstream_run_starts_it(secured: Secured) -> None:
    """``ensure_run_topics`` (every role's first call) finds the run's topics made by admin,
    with no right to create any."""
    home = str(secured.state.home)
    for role in acls.PRINCIPALS:
        settings = local_settings("trainer", home, user=role)  # as `rlstream run ROLE` does
        assert settings.sasl_username == role
        report = ensure_run_topics(settings, secured.run)
        assert not report.created and not report.drift, role


def test_rollout_writes_in_a_transaction_and_the_learner_reads_admitted(secured: Secured) -> None:
    run = secured.run
    assert _produce(secured.user("scheduler"), secured.topic("tasks")) == [None]
    # rollout: consume a task in its group, write a trajectory and commit the task's offset
    # in one transaction, as its loop does
    rollout = make_consumer(secured.user("rollout"), topics.group_id(run, "rollout"), log_level="0")
    rollout.subscribe([topics.topic_pattern(run, "tasks")])
    task = first_record(rollout)
    producer = EventProducer.transactional(secured.user("rollout"), f"{rollout_txn(run)}")
    with producer.transaction() as txn:
        producer.produce_raw(secured.topic("trajectories"), b"trajectory", b"g1")
        offsets = [TopicPartition(task.topic(), task.partition(), task.offset() + 1)]
        txn.send_offsets(offsets, rollout.consumer_group_metadata())
    rollout.close()
    # admission writes the decision transactionally; the learner reads it in its group
    admission = EventProducer.transactional(
        secured.user("admission"), f"rlstream.{run}.admission.0"
    )
    with admission.transaction():
        admission.produce_raw(secured.topic("admitted"), b"admitted-group", b"g1")
    learner = make_consumer(secured.user("learner"), topics.group_id(run, "learner"), log_level="0")
    learner.subscribe([topics.topic_pattern(run, "admitted")])
    got = first_record(learner)
    assert got.value() == b"admitted-group"
    learner.commit(message=got, asynchronous=False)
    learner.close()
    # a log reader (no group joined) catches up as the learner's user
    consumer = reader(secured.user("learner"), f"{run}.check")
    parts = _partitions(secured.topic("admitted"))
    assert [m.value() for m in read_to_end(consumer, parts, timeout=30)] == [b"admitted-group"]
    consumer.close()


def _partitions(topic: str, count: int = topics.DEFAULT_GROUP_PARTITIONS) -> list[TopicPartition]:
    return [TopicPartition(topic, p, 0) for p in range(count)]


def rollout_txn(run: str) -> str:
    return f"rlstream.{run}.rollout.trainer.0"


def test_writes_are_enforced_exactly_as_planned(secured: Secured) -> None:
    """Each role's user produces one record to every stream of the run: the broker accepts it
    where the plan grants WRITE and refuses it everywhere else."""
    grants = acls.plan(secured.run)
    for role in acls.PRINCIPALS:
        errors = _write_errors(secured.user(role), [secured.topic(s) for s in topics.RUN_STREAMS])
        for stream in topics.RUN_STREAMS:
            topic = secured.topic(stream)
            planned = acls.allowed(grants, role, "topic", topic, "write")
            err = errors[topic]
            assert (err is None) == planned, (role, stream, err)
            if err is not None:
                assert err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, (role, stream, err)


def test_roles_are_denied_what_they_must_not_do(secured: Secured) -> None:
    run = secured.run
    # rollout may not read the learner's input, nor take its group or its transactional id; a
    # record is there first (admission may write it), or the read would find nothing to fetch
    # whatever tests ran before on this cluster
    assert _produce(secured.user("admission"), secured.topic("admitted")) == [None]
    consumer = reader(secured.user("rollout"), f"{run}.peek")
    with pytest.raises(RuntimeError, match=r"[Aa]uthoriz"):
        list(read_to_end(consumer, _partitions(secured.topic("admitted")), timeout=15))
    consumer.close()
    thief = make_consumer(secured.user("rollout"), topics.group_id(run, "learner"), log_level="0")
    thief.subscribe([topics.topic_pattern(run, "tasks")])
    with pytest.raises(KafkaException) as denied:
        first_record(thief, timeout=20)
    assert denied.value.args[0].code() == KafkaError.GROUP_AUTHORIZATION_FAILED
    thief.close()
    with pytest.raises(KafkaException) as fenced:
        EventProducer.transactional(secured.user("rollout"), f"rlstream.{run}.learner.0", 15)
    assert fenced.value.args[0].code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    # a judge may not publish weights; no role may create topics
    [err] = _produce(secured.user("judge"), secured.topic("weights.manifests"))
    assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    admin = AdminClient({**secured.user("learner").librdkafka(), **QUIET})
    future = admin.create_topics([NewTopic(f"rl.{run}.extra", 1, 1)])[f"rl.{run}.extra"]
    with pytest.raises(KafkaException) as refused:
        future.result(timeout=15)
    assert refused.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


def test_the_serve_services_run_as_their_own_users_within_their_acls(secured: Secured) -> None:
    """``serve feedback`` and ``serve policy`` find the secured cluster as a role does and
    connect as ``feedback-ingest`` and ``policy-server``: the feedback service stores feedback
    and its durable dedupe reads it back, but may read no trajectory and write no admission;
    the policy server reads the weights but may write no admission, read no trajectory, nor
    take a role's transactional id."""
    run = secured.run
    where = argparse.Namespace(bootstrap=None, region=None, home=str(secured.state.home))
    feedback, policy = service_settings(where, FEEDBACK_USER), service_settings(where, POLICY_USER)
    assert (feedback.sasl_username, policy.sasl_username) == ("feedback-ingest", "policy-server")
    producer = Producer({**feedback.librdkafka(), **QUIET, "message.timeout.ms": "10000"})
    producer.produce(secured.topic("feedback"), b"fb", b"req-1", headers={"feedback_id": b"fb-1"})
    assert producer.flush(15) == 0
    with FeedbackIdLog(feedback, run, window_s=3600, max_ids=100) as seen:
        assert "fb-1" in seen
    for service, denied in ((feedback, ("admitted", "served")), (policy, ("admitted", "feedback"))):
        errors = _write_errors(service, [secured.topic(s) for s in denied])
        codes = [e.code() if e else None for e in errors.values()]
        assert codes == [KafkaError.TOPIC_AUTHORIZATION_FAILED] * 2, (service.sasl_username, errors)
    assert _write_errors(policy, [secured.topic("served")]) == {secured.topic("served"): None}
    # a record is there first (rollout may write it), or the read would find nothing to fetch
    # whatever tests ran before on this cluster (a fresh-clone run failed so)
    assert _produce(secured.user("rollout"), secured.topic("trajectories")) == [None]
    for service in (feedback, policy):
        consumer = reader(service, f"{run}.peek")
        with pytest.raises(RuntimeError, match=r"[Aa]uthoriz"):
            list(read_to_end(consumer, _partitions(secured.topic("trajectories")), timeout=15))
        consumer.close()
    consumer = reader(policy, f"{run}.weights-check")
    manifests = [TopicPartition(secured.topic("weights.manifests"), 0, 0)]
    list(read_to_end(consumer, manifests, timeout=15))  # allowed: no authorization error
    consumer.close()
    with pytest.raises(KafkaException) as fenced:
        EventProducer.transactional(policy, rollout_txn(run), 15)
    assert fenced.value.args[0].code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED


#: A run small enough for a test: one judge, groups of 4, two groups a step, a short warm start,
#: a keyframe every second version (so the learner prunes chunks at version 4).
TINY_RUN = """
group_size = 4
groups_per_step = 2
max_staleness = 2
[scheduler]
max_tasks = 12
[learner]
keyframe_every = 2
[learner.warm_start]
steps = 30
[admission]
reject_no_signal = false
judges = { tests = 1.0 }
[rollout.harness]
max_new_tokens = 24
[judges.tests]
kind = "tests"
"""


def test_the_role_loops_train_each_as_its_own_user(secured: Secured, tmp_path: Path) -> None:
    """Scheduler, rollout, a judge, admission and learner, each ``rlstream run`` finding the
    cluster in its state directory (no address, no credentials given): a group is admitted, the
    learner publishes versions and prunes its weight chunks at the third keyframe, every role
    within its own ACLs."""
    run = f"loop{uuid.uuid4().hex[:8]}"
    admin = secured.user("admin")
    apply(admin, run, secured.state.home)
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(TINY_RUN)
    extra = ["--config", str(recipe), "--set", f"learner.state_dir={tmp_path / 'learner'}"]
    extra += ["--set", f"learner.warm_start_cache={tmp_path / 'warm.pt'}"]
    roles: list[RoleProcess] = []
    for role, more in [
        ("learner", []),
        ("admission", []),
        ("judge", ["--name", "tests"]),
        ("rollout", ["--member", "0"]),
        ("scheduler", []),
    ]:
        roles.append(
            start_role(role, run, admin, tmp_path, [*more, *extra], home=secured.state.home)
        )
    try:
        admitted = _wait_for(lambda: decode_all(admin, topics.topic_name(run, "admitted")), roles)
        assert admitted[0].record["reason"] in (None, ""), admitted[0].record
        versions = _wait_for(lambda: _versions(admin, run, least=1), roles)
        assert max(versions) >= 1 and 0 in versions, versions
        # version 4 is the third keyframe: the chunks of versions 0 and 1 are deleted
        pruned = _wait_for(
            lambda: _low_watermarks(admin, topics.topic_name(run, "weights.chunks")), roles
        )
        assert max(pruned) > 0, pruned
        for r in roles:  # the scheduler ends by itself once every task is released and decided
            done = r.name == "scheduler" and r.proc.poll() == 0
            assert done or r.proc.poll() is None, f"{r.name} exited: {r.log.read_text()[-2000:]}"
    finally:
        stop_roles(roles)
    denied = [r.name for r in roles if "AUTHORIZATION_FAILED" in r.log.read_text()]
    assert denied == [], denied  # no role reached for anything its ACLs do not grant


def _versions(settings: KafkaSettings, run: str, least: int) -> list[int]:
    records = decode_all(settings, topics.topic_name(run, "weights.manifests"))
    versions = sorted({int(d.record["version"]) for d in records})
    return versions if versions and versions[-1] >= least else []


def _low_watermarks(settings: KafkaSettings, topic: str) -> list[int]:
    """The topic's low watermarks once a record of it was deleted, else []."""
    consumer = Consumer({**settings.librdkafka(), **QUIET, "group.id": "rlstream.check"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        marks = [
            consumer.get_watermark_offsets(TopicPartition(topic, p), 10)[0] for p in partitions
        ]
    finally:
        consumer.close()
    return marks if any(marks) else []


def _wait_for(found, roles: list[RoleProcess], timeout: float = 150.0):
    """Poll ``found()`` until it returns something; fail early when a role exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = found()
        if result:
            return result
        dead = [r for r in roles if r.proc.poll() is not None and r.name != "scheduler"]
        assert not dead, f"{dead[0].name} exited: {dead[0].log.read_text()[-2000:]}"
        time.sleep(2.0)
    tails = {r.name: r.log.read_text()[-800:] for r in roles}
    raise AssertionError(f"not within {timeout}s; role logs: {tails}")


def test_each_role_runs_as_its_own_os_user(secured: Secured) -> None:
    """The same loop, each role as an OS user of its own (``ops.run.os_users``): the roles'
    processes run as their users (the judge's sandbox service alone stays root, and the judge
    still scores in ``full`` isolation through it), a group is admitted and versions published;
    the judge's user can read neither the learner's signing key nor the learner's process."""
    if os_users.unavailable():
        pytest.skip(f"needs root: {os_users.unavailable()}")
    run = f"own{uuid.uuid4().hex[:8]}"
    admin = secured.user("admin")
    apply(admin, run, secured.state.home)
    shared = Path(tempfile.mkdtemp(prefix="rlstream-own-", dir="/var/tmp"))
    shared.chmod(0o755)  # the run's folder: readable by the roles' users (mkdtemp makes 0700)
    users = {role: os_users.ensure(role) for role in ("learner", "admission", "judge", "rollout")}
    os_users.give(shared / "learner", users["learner"])
    recipe = shared / "tiny.toml"
    recipe.write_text(TINY_RUN)
    extra = ["--config", str(recipe), "--set", f"learner.state_dir={shared / 'learner'}"]
    extra += ["--set", f"learner.warm_start_cache={shared / 'learner' / 'warm.pt'}"]
    roles = [
        _start_as_own_user(role, run, [*more, *extra], secured.state.home, shared)
        for role, more in [
            ("learner", []),
            ("admission", []),
            ("judge", ["--name", "tests"]),
            ("rollout", ["--member", "0"]),
        ]
    ]
    roles.append(start_role("scheduler", run, admin, shared, extra, home=secured.state.home))
    try:
        admitted = _wait_for(lambda: decode_all(admin, topics.topic_name(run, "admitted")), roles)
        assert admitted[0].record["reason"] in (None, ""), admitted[0].record
        assert max(_wait_for(lambda: _versions(admin, run, least=1), roles)) >= 1
        workers = {r.name: _children(r.proc.pid) for r in roles if r.name in users}
        for name, pids in workers.items():
            assert [_uid(p) for p in pids] == [users[name].pw_uid], (name, pids)
        service = _children(workers["judge"][0])
        assert [_uid(p) for p in service] == [0]  # the sandbox service: the only root part
        key = Path(users["learner"].pw_dir) / "weights-signing-key.pem"
        assert key.stat().st_uid == users["learner"].pw_uid and key.stat().st_mode & 0o077 == 0
        learner = workers["learner"][0]
        for secret in (key, Path(f"/proc/{learner}/environ"), Path(f"/proc/{learner}/mem")):
            assert _read_as(users["judge"], secret) == "PermissionError", secret
        assert _read_as(users["learner"], key) == "read"
    finally:
        stop_roles(roles)
    for r in roles[:-1]:
        assert f"running as {os_users.user_of(r.name)}" in r.log.read_text(), r.name
    denied = [r.name for r in roles if "AUTHORIZATION_FAILED" in r.log.read_text()]
    assert denied == [], denied
    shutil.rmtree(shared, ignore_errors=True)


def _start_as_own_user(role: str, run: str, args: list[str], home: Path, logs: Path) -> RoleProcess:
    """``rlstream run ROLE`` started as root with ``$RLSTREAM_OS_USER`` (as a launcher does).
    Where this host's interpreter lies under a private home (pyenv in /root, 0700), the role
    runs in a mount namespace of its own whose view of that home is traversable (an overlay
    with a 0711 top), as on a host whose interpreter other users may read."""
    user = os_users.ensure(role)
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "RLSTREAM_BOOTSTRAP" and not k.startswith("RLSTREAM_KAFKA_")
    }
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(os_users.Users(True, "", {role: user}).env(role))
    cmd = [sys.executable, "-m", "rlstream", "run", role, "--run", run, "--home", str(home), *args]
    private = _private_above(sys.base_prefix)
    if private is not None:
        top = logs / f"overlay-{role}"
        (top / "upper").mkdir(parents=True)
        (top / "work").mkdir()
        (top / "upper").chmod(0o711)
        opts = f"lowerdir={private},upperdir={top / 'upper'},workdir={top / 'work'}"
        mount = f'mount -t overlay overlay -o {opts} {private} && exec "$@"'
        cmd = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            mount,
            "sh",
            *cmd,
        ]
    log = logs / f"{role}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return RoleProcess(role, proc, log)


def _private_above(path: str) -> str | None:
    """The nearest folder above ``path`` that other users cannot traverse, or None."""
    for folder in [*reversed(Path(path).parents), Path(path)]:
        if not folder.stat().st_mode & stat.S_IXOTH:
            return str(folder)
    return None


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return sorted(found)


def _uid(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x[:4] == "Uid:")
    return int(line.split()[1])


def _read_as(user, path: Path) -> str:
    """``read``, or the name of the error a process of ``user`` gets reading ``path``."""
    probe = (
        "import sys\ntry:\n    open(sys.argv[1], 'rb').read(1)\n    print('read')\n"
        "except OSError as e:\n    print(type(e).__name__)"
    )
    done = subprocess.run(
        [default_python(), "-I", "-S", "-c", probe, str(path)],
        user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/",
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return done.stdout.strip() or done.stderr.strip()[-300:]
