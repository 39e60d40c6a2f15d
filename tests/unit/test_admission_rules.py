"""Admission and pacing rules, without a broker."""

from __future__ import annotations

from rlstream.consumers.admission_rules import (
    AdmissionConfig,
    PendingGroup,
    admitted_samples,
    decide,
    staleness,
    surplus,
)
from rlstream.rollout.scheduler import releasable

CFG = AdmissionConfig(judges={"tests": 1.0, "format": 0.5}, max_staleness=2, timeout_s=10)


def _group(versions: list[int], scores: list[float] | None, now: int = 0) -> PendingGroup:
    g = PendingGroup("g1", "t1", len(versions), first_seen_ms=now)
    for i, v in enumerate(versions):
        g.add_sample(
            {
                "sample_index": i,
                "policy_version": v,
                "prompt_tokens": 3,
                "token_ids": b"",
                "logprobs": b"",
                "loss_mask": b"",
                "routed_experts": b"",
                "n_layers": 0,
                "top_k": 0,
                "temperature": 1.0,
                "turns": [],
            }
        )
        for judge in ("tests", "format"):
            if scores is not None:
                g.add_reward(
                    {"sample_index": i, "judge": judge, "score": scores[i], "passed": scores[i] > 0}
                )
    return g


def test_staleness_is_learner_minus_oldest_behaviour_version():
    assert staleness(7, [5, 6, 7]) == 2
    assert staleness(3, [5]) == 0


def test_complete_fresh_group_with_signal_is_admitted_with_weighted_rewards():
    g = _group([4, 5], [1.0, 0.0])
    verdict = decide(g, 0, learner_version=5, cfg=CFG)
    assert verdict is not None and verdict.admitted and verdict.staleness == 1
    samples = admitted_samples(g, CFG)
    assert [s["reward"] for s in samples] == [1.5, 0.0]
    assert samples[0]["passed"] and not samples[1]["passed"]


def test_stale_group_is_rejected_with_reason_even_if_incomplete():
    g = _group([1, 5], None)
    verdict = decide(g, 0, learner_version=5, cfg=CFG)
    assert verdict is not None and not verdict.admitted and verdict.reason == "stale"


def test_incomplete_group_waits_then_times_out():
    g = _group([5, 5], None, now=0)
    assert decide(g, 5_000, 5, CFG) is None
    verdict = decide(g, 11_000, 5, CFG)
    assert verdict is not None and verdict.reason == "timed_out"


def test_a_group_seen_only_through_rewards_waits_for_its_samples_then_times_out():
    # rewards read before their trajectories (after a rewind), or a reward naming a sample no
    # trajectory ever named: never an empty group admitted, never an error
    g = PendingGroup("g2", "t2", 0, first_seen_ms=0)
    g.add_reward({"sample_index": 0, "judge": "tests", "score": 1.0, "passed": True})
    g.add_reward({"sample_index": 0, "judge": "format", "score": 1.0})
    for cfg in (CFG, CFG.model_copy(update={"reject_no_signal": False})):
        assert decide(g, 5_000, 5, cfg) is None
        verdict = decide(g, 11_000, 5, cfg)
        assert verdict is not None and verdict.reason == "timed_out"


def test_group_without_reward_variance_is_rejected_no_signal():
    verdict = decide(_group([5, 5], [1.0, 1.0]), 0, 5, CFG)
    assert verdict is not None and verdict.reason == "no_signal"


def test_duplicate_samples_and_rewards_are_ignored():
    g = _group([5, 5], [1.0, 0.0])
    assert not g.add_sample({"sample_index": 0, "policy_version": 9})
    assert not g.add_reward({"sample_index": 0, "judge": "tests", "score": 0.0})
    assert g.samples[0]["policy_version"] == 5


def test_pacing_keeps_in_flight_within_staleness_budget():
    assert releasable(released=0, decided=0, groups_per_step=4, max_staleness=2) == 8
    assert releasable(released=8, decided=0, groups_per_step=4, max_staleness=2) == 0
    assert releasable(released=8, decided=3, groups_per_step=4, max_staleness=2) == 3
    assert releasable(released=10, decided=0, groups_per_step=4, max_staleness=2) == 0


def test_a_budget_of_zero_releases_a_batch_only_when_the_learner_waits_for_it():
    def sync(released: int, decided: int, admitted: int, version: int) -> int:
        return releasable(released, decided, 4, 0, admitted=admitted, version=version)

    assert sync(0, 0, 0, 0) == 4  # the first batch
    assert sync(4, 3, 3, 0) == 0  # still generating or judging
    assert sync(4, 4, 4, 0) == 0  # a full batch: the learner trains it first
    assert sync(4, 4, 4, 1) == 4  # trained: the next batch
    assert sync(4, 4, 3, 0) == 1  # one group rejected: the batch lacks one
    assert sync(5, 5, 4, 0) == 0  # ... which completed it
    assert sync(9, 9, 7, 1) == 1  # after a step: 3 held, 1 lacking
    assert sync(0, 0, 0, -1) == 4  # before the first version is known


def test_an_oversampled_synchronous_release_covers_what_its_step_lacks_rounded_up():
    def sync(released: int, decided: int, admitted: int, version: int) -> int:
        return releasable(
            released, decided, 4, 0, admitted=admitted, version=version, oversample=1.5
        )

    assert sync(0, 0, 0, 0) == 6  # 4 lacking x 1.5
    assert sync(6, 5, 3, 0) == 0  # still generating or judging
    assert sync(6, 6, 3, 0) == 2  # 2 no-signal groups left it 1 short: 1 x 1.5, rounded up
    assert sync(6, 6, 4, 0) == 0  # full (the surplus rejected): the learner trains it first
    assert sync(6, 6, 4, 1) == 6  # trained: the next release
    assert releasable(0, 0, 4, 2, oversample=1.5) == 8  # asynchronous pacing ignores it
    # the release at version 3 was trained (version 4): its 2 stragglers are not waited for
    late = {"admitted": 16, "version": 4, "oversample": 1.5}
    assert releasable(24, 22, 4, 0, released_at=3, **late) == 6
    assert releasable(24, 22, 4, 0, released_at=4, **late) == 3  # 2 of this release in flight
    assert releasable(24, 22, 4, 0, released_at=None, **late) == 3  # unknown: all count
    assert sync(6, 3, 0, 0) == 2  # 3 rejected, 3 in flight cannot make 4: topped up at once
    assert releasable(24, 22, 4, 0, released_at=3, admitted=16, version=4) == 0  # no oversample


def test_past_the_cap_an_admitted_verdict_becomes_a_surplus_rejection():
    capped = CFG.model_copy(update={"max_groups_per_version": 4})
    admit = decide(_group([5, 5], [1.0, 0.0]), 0, learner_version=5, cfg=capped)
    assert admit is not None and admit.admitted
    assert surplus(admit, 3, 5, capped) is admit  # the 4th of version 5
    late = surplus(admit, 4, 5, capped)  # a 5th
    assert not late.admitted and late.reason == "other" and late.detail.startswith("surplus:")
    assert surplus(admit, 99, 5, CFG) is admit  # no cap
    no_signal = decide(_group([5, 5], [1.0, 1.0]), 0, learner_version=5, cfg=capped)
    assert no_signal is not None and surplus(no_signal, 4, 5, capped) is no_signal


def _ref(offset: int) -> dict:
    return {"topic": "rl.r.trajectories", "partition": 0, "offset": offset}


def test_a_reward_pairs_only_with_the_sample_it_names():
    # a group re-issued to the region that rolled it out: both copies share one pending group;
    # copy B's reward for sample 0 arrives first, then copy A's sample 0 and its reward
    g = PendingGroup("g3", "t3", 1, first_seen_ms=0)
    b_reward = {"sample_index": 0, "judge": "tests", "score": 0.0, "trajectory": _ref(7)}
    a_reward = {"sample_index": 0, "judge": "tests", "score": 1.0, "trajectory": _ref(3)}
    assert g.add_reward(b_reward)  # waits for its sample
    assert g.add_sample({"sample_index": 0, "policy_version": 1, "_ref": _ref(3)})
    assert g.rewards == {}  # B's reward names another record: dropped, never paired
    assert g.add_reward(a_reward)
    assert g.rewards[0]["tests"]["score"] == 1.0
    assert not g.add_reward({**b_reward, "score": 0.5})  # B's again, now that A's sample is known


def test_a_reward_from_another_regions_log_is_paired_by_index():
    # judged in a rollout region: it names that region's log, not the copy admission reads
    g = PendingGroup("g4", "t4", 1, first_seen_ms=0)
    g.add_sample({"sample_index": 0, "policy_version": 1, "_ref": _ref(3)})
    elsewhere = {"topic": "rl.r.trajectories-in-eu", "partition": 0, "offset": 99}
    assert g.add_reward(
        {"sample_index": 0, "judge": "tests", "score": 1.0, "trajectory": elsewhere}
    )
    assert g.rewards[0]["tests"]["score"] == 1.0


def test_a_group_counts_only_for_a_task_released_to_its_region() -> None:
    from rlstream.consumers.admission_rules import release_refusal

    assert release_refusal("t1", "t1", "eu", frozenset({"eu"})) is None
    assert release_refusal("t1", "t1", "us", frozenset({"eu", "us"})) is None  # re-issued
    assert release_refusal("t1", "t1", "eu", frozenset({"*"})) is None  # released before regions
    assert "never released" in str(release_refusal("t9", "t9", "eu", None))
    assert "not to region 'us'" in str(release_refusal("t1", "t1", "us", frozenset({"eu"})))
    assert "a group id is its task id" in str(release_refusal("g", "t1", "eu", frozenset({"eu"})))


def _spanning(g: PendingGroup, index: int, spans: list[tuple[int, int, int]]) -> None:
    """Give sample ``index`` version spans (version, start, end): generated across swaps."""
    g.samples[index]["version_spans"] = [
        {"version": v, "token_start": a, "token_end": b} for v, a, b in spans
    ]


def test_a_sample_spanning_versions_counts_by_its_oldest_span():
    # the writer records the oldest span as policy_version; admission reads the spans themselves
    g = _group([6, 6], [1.0, 0.0])
    _spanning(g, 0, [(3, 0, 40), (5, 40, 70), (6, 70, 90)])
    verdict = decide(g, 0, learner_version=6, cfg=CFG)
    assert verdict is not None and verdict.reason == "stale" and verdict.staleness == 3
    g = _group([6, 6], [1.0, 0.0])
    _spanning(g, 0, [(4, 0, 40), (6, 40, 90)])
    verdict = decide(g, 0, learner_version=6, cfg=CFG)
    assert verdict is not None and verdict.admitted and verdict.staleness == 2
    samples = admitted_samples(g, CFG)
    assert [s["policy_version"] for s in samples] == [4, 6]
    assert all(s["routes_recorded"] for s in samples)  # a record without the field: True
    g.samples[1]["routes_recorded"] = False
    assert [s["routes_recorded"] for s in admitted_samples(g, CFG)] == [True, False]
