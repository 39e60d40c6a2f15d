"""Where the learner keeps its state: an absolute folder (a restart from another directory finds
its checkpoints and key), checkpoints at a chosen cadence."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from rlstream.trainer.config import LearnerConfig


def test_the_state_folder_is_absolute(tmp_path: Path, monkeypatch) -> None:
    assert Path(LearnerConfig().state_dir).is_absolute()
    monkeypatch.chdir(tmp_path)
    assert LearnerConfig(state_dir="here/learner").state_dir == str(tmp_path / "here/learner")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert LearnerConfig(state_dir="~/s").state_dir == str(tmp_path / "home/s")


def test_the_checkpoint_cadence_is_at_least_every_version() -> None:
    assert LearnerConfig().checkpoint_every == 1
    assert LearnerConfig(checkpoint_every=5).checkpoint_every == 5
    with pytest.raises(pydantic.ValidationError):
        LearnerConfig(checkpoint_every=0)
