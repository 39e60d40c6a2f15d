"""Roles as their own OS users (``ops.run.os_users``): where the host does not allow it the
launcher gets the reason (and records a downgrade); what it hands a role when it does."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from rlstream.ops.run import os_users
from rlstream.producers.weights.run_keys import TRUST_DIR_ENV


def test_not_root_is_a_recorded_downgrade_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    users = os_users.prepare(["learner", "judge"], {"learner": [Path("/nowhere")]}, [])
    assert not users.enabled and "root" in users.reason
    assert users.env("learner") == {}
    assert users.record() == {"enabled": False, "reason": users.reason, "users": {}}


def test_a_role_is_given_its_user_its_home_and_pins_of_its_own() -> None:
    user = pwd.struct_passwd(
        ("rlstream-judge", "x", 990, 990, "", "/var/lib/u/judge", "/bin/false")
    )
    users = os_users.Users(True, "", {"judge": user})
    assert users.env("judge") == {
        os_users.OS_USER_ENV: "rlstream-judge",
        "HOME": "/var/lib/u/judge",
        TRUST_DIR_ENV: "/var/lib/u/judge/.config/rlstream/trust",
    }
    assert users.env("learner") == {}  # a role not planned runs as the launcher's user
    assert users.record()["users"] == {"judge": "rlstream-judge"}
