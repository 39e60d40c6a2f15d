"""``policy.hf_dir`` is checked when the config is read: a folder the policy adapter cannot
drive is refused with the reason, before any role starts (``rollout.config.check_model_dir``)."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest

from rlstream.rollout.config import PolicyConfig


def _folder(tmp_path: Path, model_type: str = "llama", tokenizer: bool = True) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    if tokenizer:
        (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: p / "missing", "no such folder"),
        (lambda p: p, "no readable config.json"),
        (lambda p: _folder(p / "gpt2", "gpt2"), "model_type 'gpt2' is not one"),
        (lambda p: _folder(p / "bare", tokenizer=False), "no tokenizer"),
    ],
)
def test_a_folder_it_cannot_drive_is_refused_with_the_reason(tmp_path: Path, make, why) -> None:
    with pytest.raises(pydantic.ValidationError, match=why):
        PolicyConfig(hf_dir=str(make(tmp_path)))


def test_a_usable_folder_is_kept_as_an_absolute_path(tmp_path: Path, monkeypatch) -> None:
    _folder(tmp_path / "m", "qwen3_moe")
    monkeypatch.chdir(tmp_path)
    assert PolicyConfig(hf_dir="m").hf_dir == str(tmp_path / "m")
