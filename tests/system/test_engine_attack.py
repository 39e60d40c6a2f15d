"""``engine_weights_corrupted`` (``ops.chaos.engine_attack``) on a real vLLM server: each way of
corrupting the engine's weights in place is caught by the check after the next version and
repaired, so every attempt counts as refused; the counting itself is no tautology, an engine
left without its checks lets both through."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_support import requires_vllm

from rlstream.ops.chaos import engine_attack

pytestmark = [pytest.mark.slow, requires_vllm]


def test_every_corruption_is_caught_and_repaired(tmp_path: Path) -> None:
    assert engine_attack.engine_weights_corrupted(tmp_path / "checked").as_dict() == {
        "tried": 2,
        "refused": 2,
    }


def test_without_the_checks_nothing_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlstream.rollout.vllm_engine import VllmEngine

    monkeypatch.setattr(VllmEngine, "_verify", lambda self, *args, **kwargs: None)
    attempts = engine_attack.engine_weights_corrupted(tmp_path / "unchecked")
    assert attempts.as_dict() == {"tried": 2, "refused": 0}
