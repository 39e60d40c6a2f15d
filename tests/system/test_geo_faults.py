"""Multi-region runs surviving faults, on real brokers and MirrorMaker 2 (the session's ``geo``
cluster: regions trainer, eu and us, one MirrorMaker per link, each link a WAN of 20 ms RTT).

Each test runs a short asynchronous GRPO run with every role its own process, breaks something
mid-run, and reconciles the ledger at the end: every released group decided exactly once
(nothing lost), none trained twice, only admitted groups trained.

- a MirrorMaker outage alone: the backlog crosses when it returns, and exactly once;
- the trainer region's broker killed and restarted: every role reconnects and resumes by itself;
- a rollout region cut off (its WAN link a black hole for minutes, the region itself running
  on): the scheduler re-issues its overdue groups to the other region; after the heal its late
  copies cross and are ignored, and it applies the latest weights.
"""

from __future__ import annotations

import collections
import time

import pytest
from geo_pipeline import GeoRun, settings_of
from helpers import decode_all

from rlstream.ops import cluster
from rlstream.ops.bench.slow_env import slow_sets
from rlstream.ops.chaos import faults
from rlstream.ops.run import services
from rlstream.schemas import topics

pytestmark = pytest.mark.slow
QUIET = {"log": lambda *_: None}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("geo-runs")  # one warm start shared by the module's runs


def _restore(geo) -> None:
    cluster.up(["trainer", "eu", "us"], home=geo.home, heap="384m", **QUIET)


def _samples(settings, topic: str) -> list[tuple[str, int]]:
    return [(d.record["group_id"], d.record["sample_index"]) for d in decode_all(settings, topic)]


def test_a_mirrormaker_outage_delays_the_backlog_and_copies_it_once(geo, tmp, unique_run):
    # each group takes at least 2 s in eu, so when the link dies after the first trajectories
    # crossed, eu still holds released tasks whose trajectories pile up behind the outage
    slow_env = slow_sets(2, 0)
    run = GeoRun(
        geo.home, unique_run, tmp, ["eu"], 16, ["scheduler.reissue_after_s=300", *slow_env]
    )
    try:
        run.start()
        run.wait(lambda: run.arrived("eu") > 0, 240, "the first trajectories from eu")
        for link in cluster.load(geo.home).link_mirrors("eu"):  # both ways of the link
            services.kill9(link.pid)
        eu, home = settings_of(geo.home, "eu"), run.home_settings()
        local = topics.topic_name(run.run, "trajectories")

        def backlog() -> int:
            return len(_samples(eu, local)) - len(_samples(home, f"eu.{local}"))

        run.wait(lambda: backlog() > 0, 90, "trajectories to pile up in eu")
        _restore(geo)
        run.wait(lambda: run.decided_count() >= run.tasks, 240, "every group decided")
        ledger = run.reconcile()
        copied = collections.Counter(_samples(home, f"eu.{local}"))
        assert copied == collections.Counter(_samples(eu, local)), "the copy differs from eu"
        assert max(copied.values()) == 1, "MirrorMaker copied a sample twice"
        assert not ledger.reissued
    finally:
        run.stop()
        _restore(geo)


def test_the_trainer_broker_restarted_every_role_resumes_by_itself(
    geo, tmp, unique_run, monkeypatch
):
    monkeypatch.setenv("RLSTREAM_HUNG_TRANSACTION_S", "30")  # a role stuck after the restart
    run = GeoRun(geo.home, unique_run, tmp, ["eu"], 16, ["scheduler.reissue_after_s=300"])
    try:
        run.start()
        run.wait(lambda: run.decided_count() >= 2, 240, "the first groups")
        before = cluster.load(geo.home)
        # the broker alone comes back (as a supervisor would restart it), on its data and ports
        faults.restart_broker(geo.home, "trainer", "384m", down_s=5)
        # alone about a minute; on a busy 2-core machine the broker's restart alone took ~140 s
        run.wait(lambda: run.decided_count() >= run.tasks, 480, "every group decided")
        ledger = run.reconcile()
        assert len(ledger.trained) >= 2
        alive = [n for n, p in run.procs.items() if p.poll() is None]
        assert set(alive) >= {"learner", "admission", "judge-tests", "rollout-eu"}
        after = cluster.load(geo.home)
        assert after.mirrors["eu"].running() and after.mirrors["eu"].pid == before.mirrors["eu"].pid
    finally:
        run.stop()
        _restore(geo)


def test_a_cut_link_is_worked_around_and_the_regions_late_copies_are_trained_never(
    geo, tmp, unique_run
):
    run = GeoRun(
        geo.home,
        unique_run,
        tmp,
        ["eu", "us"],
        16,
        # long enough for us to finish a group on a loaded machine: a shorter one re-issued
        # us's groups back to the cut eu and bounced them between the regions in CI
        ["scheduler.reissue_after_s=60", "admission.timeout_s=120"],
    )
    cut = False
    try:
        run.start()
        run.wait(lambda: run.arrived("eu") > 0, 240, "the first trajectories from eu")
        cluster.cut_link("eu", geo.home)
        cut, cut_at = True, time.monotonic()
        run.wait(lambda: run.ledger().reissued, 240, "a group re-issued away from eu")
        run.wait(lambda: run.decided_count() >= run.tasks, 420, "every group decided without eu")
        dark_s = time.monotonic() - cut_at
        cluster.heal_link("eu", geo.home)
        cut = False
        ledger = run.ledger()
        late = {t for t in ledger.reissued if ledger.released[t][0][1] == "eu"}
        assert late, "no group of eu was re-issued"
        home = run.home_settings()
        eu_copy = f"eu.{topics.topic_name(run.run, 'trajectories')}"

        def late_copy_home() -> bool:
            return bool(late & {g for g, _ in _samples(home, eu_copy)})

        run.wait(late_copy_home, 180, "a late copy from eu to cross home after the heal")
        run.wait(
            lambda: run.weights_crossed("eu"),
            180,
            "eu to hold every weight manifest after the heal",
        )
        time.sleep(10)  # admission reads the late copy
        ledger = run.reconcile()
        for group in late:
            assert ledger.released[group][-1][1] == "us", ledger.released[group]
        print(f"link cut {dark_s:.0f} s; {len(late)} groups of eu re-issued to us")
    finally:
        if cut:
            cluster.heal_link("eu", geo.home)
        run.stop()
        _restore(geo)
