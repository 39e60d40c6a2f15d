"""A role loads what its work needs: the roles that neither generate nor train start without
torch, measured as ``rlstream bench role-start`` measures them (a fresh interpreter doing what
``rlstream run ROLE`` does before its first Kafka call)."""

from __future__ import annotations

from rlstream.ops.bench import role_start

#: Roles that move no tensors: each starts in a fraction of a second without these.
LIGHT = ("scheduler", "admission", "judge", "feedback-rl", "tracker", "capacity")


def test_the_light_roles_start_without_the_heavy_libraries() -> None:
    for role in LIGHT:
        measured = role_start._measure("", role, 1)
        assert measured["loaded"] == [], (role, measured)
        assert measured["from"].startswith(str(role_start.Path(__file__).resolve().parents[2]))


def test_every_started_role_is_measured() -> None:
    assert set(LIGHT) | {"rollout", "learner", "eval"} == set(role_start._roles())
