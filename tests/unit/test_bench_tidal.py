"""The pure parts of ``bench tidal``: the emulated serving fleet's queue and metrics, and how
tokens generated again after a reclaim are counted."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rlstream.ops.bench.tidal import ServingFleet, _group_tokens, _poisson
from rlstream.rollout.capacity import buckets, parse_metrics, quantile_ms
from rlstream.rollout.checkpoint import GroupCheckpoint, RowState
from rlstream.schemas.arrays import TokenArrays


def _fleet(lent: int, load: float, engines: int = 4) -> ServingFleet:
    fleet = ServingFleet(engines, 0.25, lambda now: load, lambda: lent, seed=1)
    fleet._last = 0.0
    return fleet


def test_the_engines_not_lent_serve_first_come_first_served() -> None:
    fleet = _fleet(lent=3, load=0.0)
    fleet.queue.extend([0.0, 0.0, 0.0])  # three requests at t 0, one engine serving
    for k in range(1, 60):
        fleet.tick(k * 0.02)
    assert [round(lat, 2) for _, lat in fleet.done] == [0.25, 0.5, 0.75]
    assert fleet.free_at[:3] == [0.0, 0.0, 0.0]  # the lent engines took nothing


def test_metrics_read_back_as_vllm_metrics() -> None:
    fleet = _fleet(lent=0, load=0.0)
    fleet.queue.extend([0.0] * 6)
    fleet.tick(0.02)  # four start, two wait
    page = parse_metrics(fleet.metrics(0.1))
    assert page["vllm:num_requests_running"][0][1] == 4
    assert page["vllm:num_requests_waiting"][0][1] == 2
    later = buckets(parse_metrics(fleet.metrics(1.0)))
    assert later[float("inf")] == 4  # the four finished by then; the two are still queued
    assert quantile_ms({}, later, 0.99) == 250.0


def test_load_sets_the_arrival_rate() -> None:
    rng = random.Random(3)
    draws = [_poisson(rng, 0.4) for _ in range(20_000)]
    assert sum(draws) / len(draws) == pytest.approx(0.4, rel=0.05)
    fleet = _fleet(lent=0, load=0.5)  # 0.5 x 4 engines / 0.25 s = 8 a second
    for k in range(1, 1001):
        fleet.tick(k * 0.02)  # 20 s
    assert len(fleet.done) == pytest.approx(160, rel=0.25)


def _row(tokens: list[int], generated: int) -> RowState:
    t = len(tokens)
    mask = np.zeros(t, np.uint8)
    mask[t - generated :] = 1
    return RowState(
        tokens=np.asarray(tokens, np.int32),
        logprobs=np.zeros(t, np.float32),
        mask=mask,
        routes=np.zeros((t, 1, 1), np.uint8),
        versions=np.zeros(t, np.int64),
    )


def _sample(tokens: list[int], generated: int) -> TokenArrays:
    row = _row(tokens, generated)
    return TokenArrays(row.tokens, row.logprobs, row.mask, row.routes)


def test_a_resumed_sample_counts_its_carried_tokens_once() -> None:
    cut = GroupCheckpoint("p", [_row([1, 2, 3, 4], 2)])  # prompt 1 2, generated 3 4
    resumed = {("w2", 1): [_sample([1, 2, 3, 4, 5, 6], 4)]}  # 3 4 carried, 5 6 new
    assert _group_tokens(resumed, [cut]) == (4, 4)  # nothing generated twice
    started_over = {("w2", 1): [_sample([1, 2, 7, 8, 9], 3)]}  # a copy from scratch
    assert _group_tokens(started_over, [cut]) == (5, 3)  # the cut's 2 tokens were wasted
