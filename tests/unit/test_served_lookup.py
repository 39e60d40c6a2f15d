"""Feedback that names a served request, without a broker: what ``consumers.feedback.served_log``
copies in.

Properties: a served completion (the record ``serve policy`` writes) turns feedback carrying only
its request id into an admitted online sample whose tokens, behaviour logprobs and routes are the
served ones bit for bit, with the served policy version and temperature; feedback whose request
is not found is untrainable with the reason, and a bad choice index is refused by name.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from test_serve_shapes import _context, _generated

from rlstream.consumers.feedback.rules import FeedbackRLConfig, Item, untrainable, window_decisions
from rlstream.consumers.feedback.served_log import (
    NotServed,
    ServedCompletion,
    feedback_choice,
    remember,
    with_served,
)
from rlstream.envs import protocol
from rlstream.rollout.serve import served_choice, served_record
from rlstream.schemas import events


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _feedback(i: int, action: str, **over: object) -> dict:
    return {
        "feedback_id": f"fb-{i}",
        "request_id": "req-abc",
        "run": "r1",
        "policy_version": 0,  # what the client says; the served record's version wins
        "model": "policy",
        "action": action,
        "task_class": "tab",
        "user_id_hash": "h",
        "received_ms": 1,
        "metadata": {},
        **over,
    }


def test_feedback_naming_a_served_request_becomes_an_admitted_online_sample() -> None:
    out, prompt = _generated(top_n=0)
    ctx = _context()
    items = []
    for row, action in enumerate(("accepted", "rejected")):
        choice = served_choice(out, row, prompt)
        rec = served_record(ctx, row, 2, choice, protocol.decode(choice.token_ids))
        served = events.decode(events.encode("trajectory", rec)).record
        ref = {"topic": "rl.r1.served", "partition": 3, "offset": 10 + row}
        feedback = _feedback(row, action, metadata={"choice": str(row)})
        assert feedback_choice(feedback) == row
        value = with_served(feedback, ServedCompletion(served, ref))
        assert untrainable(value, "policy") is None
        items.append((value, served))
    cfg = FeedbackRLConfig(min_group_size=2, max_group_size=8)
    window = [
        Item(v, {"topic": "rl.r1.feedback", "partition": 3, "offset": i})
        for i, (v, _) in enumerate(items)
    ]
    [group], _ = window_decisions(window, "w", 7, {}, cfg, "r1", 1000)
    events.validate("admission", group)
    assert group["decision"] == "admitted" and group["source"] == "online"
    for sample, (value, served) in zip(group["samples"], items, strict=True):
        assert (
            sample["token_ids"] == served["token_ids"] and sample["logprobs"] == served["logprobs"]
        )
        assert sample["routed_experts"] == served["routed_experts"]
        assert sample["policy_version"] == 7 and sample["temperature"] == 0.8
        assert sample["trajectory"] == value["trajectory_ref"]


def test_feedback_whose_completion_is_not_found_is_untrainable_with_the_reason() -> None:
    value = {**_feedback(0, "accepted"), "lookup_error": "request 'req-x' is not among ..."}
    assert "not found" in str(untrainable(value, "policy"))
    with pytest.raises(NotServed, match=r"metadata\.choice"):
        feedback_choice(_feedback(0, "accepted", metadata={"choice": "first"}))


def test_the_index_keeps_the_newest_request_ids_only() -> None:
    ids: OrderedDict[str, list[int]] = OrderedDict()
    for offset in range(10):
        remember(ids, f"req-{offset // 2}", offset, max_ids=3)  # two records per request
    assert list(ids) == ["req-2", "req-3", "req-4"]
    assert ids["req-4"] == [8, 9]
    remember(ids, "req-2", 10, max_ids=3)  # a later record makes its request the newest
    remember(ids, "req-5", 11, max_ids=3)
    assert list(ids) == ["req-4", "req-2", "req-5"]


def test_the_task_class_is_the_served_requests_not_the_feedbacks() -> None:
    """A feedback client cannot move another class's baseline: the class is what the request
    was served as (``task_class`` of the completion request, recorded), else the default."""
    from dataclasses import replace

    from rlstream.rollout.serve import CompletionRequest, sampling_settings

    out, prompt = _generated(top_n=0)
    choice = served_choice(out, 0, prompt)
    ref = {"topic": "rl.r1.served", "partition": 0, "offset": 1}
    for asked, expected in (("tab", "tab"), (None, None)):
        req = CompletionRequest(model="policy", prompt="x", task_class=asked)
        ctx = replace(_context(), settings=sampling_settings(req, seed=5, prompt_truncated=False))
        rec = served_record(ctx, 0, 1, choice, protocol.decode(choice.token_ids))
        served = events.decode(events.encode("trajectory", rec)).record
        value = with_served(
            _feedback(0, "accepted", task_class="agent"), ServedCompletion(served, ref)
        )
        assert value["task_class"] == expected
