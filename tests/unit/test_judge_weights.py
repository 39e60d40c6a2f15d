"""The rewards admission waits for are the run's judges (``[judges]``), each weighted by its own
``weight``: a recipe that defines other judges than the default two trains, and an
``admission.judges`` naming a judge the run lacks is refused when the recipe is read."""

from __future__ import annotations

import json

import pytest

from rlstream.ops.run.config import ConfigInvalid, load_run_config

OWN = {"tests": {"kind": "tests"}, "rubric": {"kind": "llm", "weight": 0.5}}


def test_admission_waits_for_the_runs_own_judges() -> None:
    assert load_run_config(None, []).role("admission").judges == {"tests": 1.0, "format": 0.1}
    own = load_run_config(None, [f"judges={json.dumps(OWN)}"])
    assert own.role("admission").judges == {"tests": 1.0, "rubric": 0.5}


def test_named_admission_judges_must_be_judges_of_the_run() -> None:
    named = load_run_config(None, ['admission.judges={"tests": 2.0}'])
    assert named.role("admission").judges == {"tests": 2.0}  # the recipe's own choice stands
    with pytest.raises(ConfigInvalid, match="names style, which"):
        load_run_config(None, ['admission.judges={"tests": 1.0, "style": 0.2}'])
