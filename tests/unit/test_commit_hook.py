"""The commit-msg hook `make setup` installs: a subject of at most 72 characters, then a blank
line before the body."""

from __future__ import annotations

import subprocess
from pathlib import Path

HOOK = Path(__file__).resolve().parents[2] / ".githooks" / "commit-msg"


def _hook(tmp_path: Path, message: str) -> int:
    path = tmp_path / "MSG"
    path.write_text(message)
    return subprocess.run(["bash", str(HOOK), str(path)], capture_output=True).returncode


def test_the_hook_takes_a_short_subject_and_refuses_a_long_one(tmp_path: Path) -> None:
    assert _hook(tmp_path, "feedback-rl: a completion is trained once\n\nWhy, numbers.\n") == 0
    assert _hook(tmp_path, "x" * 72 + "\n# a comment line git strips\n") == 0
    assert _hook(tmp_path, "x" * 73 + "\n") == 1
    assert _hook(tmp_path, "subject\nbody on the second line\n") == 1
