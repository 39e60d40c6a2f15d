"""Negative controls for the run ledger: fed a known loss, a duplicate and a spurious rejection,
the figures flag each one, and the chaos bench's rule no longer holds.

A clean run is the baseline each case spoils once (``ops.observe.ledger``).
"""

from __future__ import annotations

from typing import Any

from rlstream.ops.bench.chaos_report import held
from rlstream.ops.observe.ledger import Ledger

A, B, C = "task-a", "task-b", "task-c"
REF = {g: ("rl.r.admitted", 0, i) for i, g in enumerate((A, B, C))}


def _clean() -> Ledger:
    """Three tasks released, decided once, A and B admitted and trained once each (one step),
    C rejected for a verdict on its samples."""
    return Ledger(
        released={A: [(0, None)], B: [(0, None)], C: [(0, None)]},
        decided={A: ["admitted"], B: ["admitted"], C: ["no_signal"]},
        trained=[A, B],
        inputs=[(REF[A], A), (REF[B], B)],
    )


def _held(figures: dict[str, Any]) -> bool:
    run = {**figures, "poison_trained": 0, "roles_given_up": 0, "genuine_refused": 0}
    return held({**run, "feedback_stored": 1, "attacks": {"x": {"tried": 1, "refused": 1}}})


def test_a_clean_ledger_flags_nothing() -> None:
    f = _clean().figures()
    assert (f["groups_lost"], f["groups_trained_twice"], f["inputs_trained_twice"]) == (0, 0, 0)
    assert (f["groups_admitted_untrained"], f["groups_rejected_unjudged"]) == (0, 0)
    assert f["inputs_trained"] == 2 and _held(f)


def test_a_lost_group_is_flagged() -> None:
    ledger = _clean()
    del ledger.decided[C]  # released, never decided
    f = ledger.figures()
    assert f["groups_lost"] == 1 and not _held(f)


def test_an_input_named_twice_in_one_step_is_trained_twice() -> None:
    ledger = _clean()
    ledger.inputs.append((REF[A], A))  # the same admitted record twice in one manifest
    f = ledger.figures()
    assert f["inputs_trained_twice"] == 1 and f["groups_trained_twice"] == 1
    assert not _held(f)


def test_a_group_trained_in_two_steps_is_flagged() -> None:
    ledger = _clean()
    ledger.trained.append(A)  # a later version trains A again
    ledger.inputs.append((REF[A], A))
    f = ledger.figures()
    assert f["groups_trained_twice"] == 1 and not _held(f)


def test_a_spurious_rejection_and_an_untrained_admission_are_reported() -> None:
    ledger = _clean()
    ledger.decided[C] = ["judge_error"]  # no verdict on the samples: the judge failed
    ledger.trained, ledger.inputs = [A], [(REF[A], A)]  # B admitted, never trained
    f = ledger.figures()
    assert f["groups_rejected_unjudged"] == 1 and f["groups_admitted_untrained"] == 1
