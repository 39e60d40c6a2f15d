"""A secured multi-region cluster: MirrorMaker 2 copies committed records across a link as its
own user, within the ACLs ``ops.run.acls.mirror_grants`` plans; a rollout worker's user in the
rollout region reads the trainer region's copies and its trajectories cross home; every cluster
refuses a client that does not authenticate.

The module starts its own secured ``trainer`` and ``eu`` regions and their link
(``cluster.up(secure=True)``) in a temporary state directory, applies one run's ACLs in both
regions (``rlstream acl apply --regions trainer,eu [--region eu]``: the roles' that run there,
and the run's streams on the link), and stops exactly those brokers and that MirrorMaker, by pid. Its fixture is named ``geo`` so that ``tests/conftest.py`` runs it
last, with the other tests that keep several brokers alive.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from helpers import first_record

from rlstream.consumers.consumer import make_consumer
from rlstream.consumers.read_to_end import partitions_of, read_to_end, reader
from rlstream.ops import cluster
from rlstream.ops.cli.cmd_acl import apply
from rlstream.ops.run import acls
from rlstream.producers.client.producer import EventProducer
from rlstream.producers.client.settings import KafkaSettings
from rlstream.schemas import topics

pytestmark = pytest.mark.timeout(300)

QUIET = {"log_level": 0}
MIRROR = acls.mirror_user("eu")
REGIONS = topics.Regions("trainer", ("eu",))


@dataclass
class SecuredLink:
    state: cluster.Cluster
    run: str


@pytest.fixture(scope="module")
def geo() -> Iterator[SecuredLink]:
    if KafkaSettings.from_env() is not None:
        pytest.skip("needs the local launcher to start secured regions")
    with tempfile.TemporaryDirectory(prefix="rlstream-secure-geo-") as tmp:
        home = Path(tmp) / "cluster"
        try:
            state = cluster.up(["trainer", "eu"], home=home, heap="384m", secure=True, log=_quiet)
            run = f"sgeo{uuid.uuid4().hex[:8]}"
            for here in REGIONS.names:
                apply(state.settings(here), run, home, REGIONS, here)
            cluster.authorize_links(state, run)
            yield SecuredLink(state, run)
        finally:
            cluster.down(home=home, purge=True, log=_quiet)


def _quiet(*_: object) -> None:
    pass


def _refused(settings: KafkaSettings) -> bool:
    admin = AdminClient({**settings.librdkafka(), **QUIET})
    try:
        admin.list_topics(timeout=5)
    except KafkaException:
        return True
    return False


def _values(settings: KafkaSettings, topic: str, timeout: float = 60.0) -> list[bytes]:
    """The committed values of ``topic`` once it exists and holds a record, else []."""
    consumer = reader(settings, "check")
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            parts = partitions_of(consumer, topic)
            if parts:
                starts = [TopicPartition(topic, p, 0) for p in parts]
                values = [m.value() or b"" for m in read_to_end(consumer, starts, timeout=20)]
                if values:
                    return values
            time.sleep(1.0)
    finally:
        consumer.close()
    return []


def test_the_link_copies_committed_records_only_as_its_own_user(geo: SecuredLink) -> None:
    """The learner's user publishes a manifest in an aborted transaction, then one in a committed
    transaction, in the trainer region; eu's copy holds the committed one only, and the
    MirrorMaker's log shows no refusal."""
    state, run = geo.state, geo.run
    topic = topics.topic_name(run, "weights.manifests")
    learner = EventProducer.transactional(
        state.settings("trainer", "learner"), f"rlstream.{run}.learner.0"
    )
    with pytest.raises(RuntimeError), learner.transaction():
        learner.produce_raw(topic, b"aborted", b"m")
        learner.flush(15)
        raise RuntimeError("roll the publish back")
    with learner.transaction():
        learner.produce_raw(topic, b"committed", b"m")
    learner.close()
    copy = topics.remote_topic("trainer", topic)
    assert _values(state.settings("eu"), copy) == [b"committed"]
    log = state.mirrors["eu"].log.read_text(errors="replace")
    assert "AuthorizationException" not in log and "AUTHORIZATION_FAILED" not in log


def test_both_regions_refuse_an_unauthenticated_client(geo: SecuredLink) -> None:
    for region in ("trainer", "eu"):
        bootstrap = geo.state.bootstrap(region)
        assert _refused(KafkaSettings(bootstrap_servers=bootstrap)), region
        assert not _refused(geo.state.settings(region, MIRROR)), region


def test_the_link_user_is_denied_what_does_not_flow(geo: SecuredLink) -> None:
    """The link's user may not read a stream that stays home, write a local stream or create a
    topic of a run."""
    state, run = geo.state, geo.run
    mirror = state.settings("trainer", MIRROR)
    consumer = reader(mirror, f"{run}.peek")
    admitted = topics.topic_name(run, "admitted")
    meta = consumer.list_topics(admitted, timeout=10).topics[admitted]
    consumer.close()
    assert meta.error is not None and meta.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    errors: list[KafkaError | None] = []
    producer = Producer({**mirror.librdkafka(), **QUIET, "message.timeout.ms": "10000"})
    producer.produce(
        topics.topic_name(run, "tasks"), b"forged", on_delivery=lambda e, _m: errors.append(e)
    )
    producer.flush(15)
    assert [e.code() if e else None for e in errors] == [KafkaError.TOPIC_AUTHORIZATION_FAILED]
    admin = AdminClient({**state.settings("eu", MIRROR).librdkafka(), **QUIET})
    name = topics.topic_name(run, "tasks")  # a local topic of the rollout region
    with pytest.raises(KafkaException) as refused:
        admin.create_topics([NewTopic(name, 1, 1)])[name].result(timeout=15)
    assert refused.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


def test_a_rollout_worker_in_eu_works_on_the_copies_as_its_own_user(geo: SecuredLink) -> None:
    """The scheduler's user releases a task at home; in eu the rollout user consumes its copy
    ``trainer.rl.RUN.tasks`` in the rollout group and writes a trajectory with the task's offset
    in one transaction, as its loop does; admission's user reads it home as
    ``eu.rl.RUN.trajectories``. The local ``rl.RUN.tasks`` of eu (nobody writes it) is not
    readable there, and a role that does not run in eu has no user there."""
    state, run = geo.state, geo.run
    tasks = topics.topic_name(run, "tasks")
    scheduler = Producer({**state.settings("trainer", "scheduler").librdkafka(), **QUIET})
    scheduler.produce(tasks, b"task", b"t1")
    assert scheduler.flush(15) == 0
    eu = state.settings("eu", "rollout")
    worker = make_consumer(eu, topics.group_id(run, "rollout"), log_level="0")
    worker.subscribe([REGIONS.pattern(run, "tasks", "eu")])
    task = first_record(worker, timeout=60)
    assert (task.topic(), task.value()) == (f"trainer.{tasks}", b"task")
    producer = EventProducer.transactional(eu, f"rlstream.{run}.rollout.eu.0")
    with producer.transaction() as txn:
        producer.produce_raw(topics.topic_name(run, "trajectories"), b"trajectory", b"g1")
        offsets = [TopicPartition(task.topic(), task.partition(), task.offset() + 1)]
        txn.send_offsets(offsets, worker.consumer_group_metadata())
    producer.close()
    worker.close()
    home = topics.remote_topic("eu", topics.topic_name(run, "trajectories"))
    assert _values(state.settings("trainer", "admission"), home) == [b"trajectory"]
    assert _read_error(eu, tasks) == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert _refused(state.settings("eu", "learner"))


def _read_error(settings: KafkaSettings, topic: str, timeout: float = 20.0) -> int | None:
    """The error code of fetching partition 0 of ``topic`` (None: readable, if empty)."""
    consumer = reader(settings, "peek")
    consumer.assign([TopicPartition(topic, 0, 0)])
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            if err is None or err.code() == KafkaError._PARTITION_EOF:
                return None
            return int(err.code())
    finally:
        consumer.close()
    return None
