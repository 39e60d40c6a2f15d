"""Which admitted groups form the learner's next step, and what is committed. No broker."""

from __future__ import annotations

from rlstream.consumers.feedback.rules import online_quota
from rlstream.trainer.learner import commit_offsets, pick_step
from rlstream.trainer.learner_step import StepInput


def _g(source: str, ref: tuple[str, int, int]) -> StepInput:
    return StepInput({"source": source}, [ref])


def test_groups_are_taken_in_arrival_order_without_a_quota():
    waiting = [_g("rollout", ("a", 0, i)) for i in range(5)]
    assert pick_step(waiting, 4, lambda r: None, 0, 0) == [0, 1, 2, 3]
    assert pick_step(waiting[:3], 4, lambda r: None, 0, 0) is None


def test_online_groups_wait_for_their_share_of_rollout_groups():
    quota = lambda rollout: online_quota(rollout, 1, 2)  # noqa: E731 - one online per two rollout
    waiting = [
        _g("online", ("a", 0, 0)),
        _g("rollout", ("a", 0, 1)),
        _g("online", ("a", 0, 2)),
        _g("rollout", ("a", 0, 3)),
        _g("rollout", ("a", 0, 4)),
    ]
    # the first online group needs 2 rollout groups before it: it is taken after them
    assert pick_step(waiting, 3, quota, 0, 0) == [1, 3, 4]
    assert pick_step(waiting, 3, quota, 2, 0) == [0, 1, 3]


def test_commit_stops_before_the_first_record_still_waiting():
    used = [_g("rollout", ("a", 0, 5)), _g("rollout", ("a", 1, 7))]
    waiting = [_g("online", ("a", 0, 3))]
    offsets = {(tp.topic, tp.partition): tp.offset for tp in commit_offsets(used, waiting)}
    assert offsets == {("a", 0): 3, ("a", 1): 8}
