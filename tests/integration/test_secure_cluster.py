"""A secured broker enforces the role plan: who cannot connect, what each role may and may not do.

The module starts its own secured broker (``cluster.up(secure=True)``) in a temporary state
directory, applies the ACLs of one run as ``admin`` (``rlstream acl apply``), then connects as
each role's user. It stops exactly that broker, by pid.
"""

from __future__ import annotations

import stat
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
from pydantic import SecretStr

from rlstream.consumers.consumer import make_consumer
from rlstream.consumers.read_to_end import read_to_end, reader
from rlstream.ops import acls, cluster
from rlstream.ops.cluster import security
from rlstream.ops.cmd_acl import apply
from rlstream.ops.regions import local_settings
from rlstream.producers.admin import ensure_run_topics
from rlstream.producers.producer import EventProducer
from rlstream.producers.settings import KafkaSettings
from rlstream.schemas import topics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

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
    task = _first(rollout)
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
    got = _first(learner)
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


def _first(consumer: Consumer, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is None:
            continue
        if msg.error() is not None:
            raise KafkaException(msg.error())
        return msg
    raise AssertionError(f"no record within {timeout}s")


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
    # rollout may not read the learner's input, nor take its group or its transactional id
    consumer = reader(secured.user("rollout"), f"{run}.peek")
    with pytest.raises(RuntimeError, match=r"[Aa]uthoriz"):
        list(read_to_end(consumer, _partitions(secured.topic("admitted")), timeout=15))
    consumer.close()
    thief = make_consumer(secured.user("rollout"), topics.group_id(run, "learner"), log_level="0")
    thief.subscribe([topics.topic_pattern(run, "tasks")])
    with pytest.raises(KafkaException) as denied:
        _first(thief, timeout=20)
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
