"""``schemas.derive``: a changed config is validated, and keeps which fields were set."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from rlstream.schemas.derive import derive


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    turns: int = 4


class Outer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "policy"
    staleness: int = 2
    inner: Inner = Inner()

    @field_validator("staleness")
    @classmethod
    def _not_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError("staleness must be >= 0")
        return value


def test_a_change_lands_and_the_rest_is_kept() -> None:
    base = Outer(name="mine")
    out = derive(base, staleness=3, inner=derive(base.inner, turns=8))
    assert (out.name, out.staleness, out.inner.turns) == ("mine", 3, 8)
    assert out.model_fields_set == {"name", "staleness", "inner"}
    assert base.staleness == 2  # the original is untouched


def test_a_change_that_breaks_a_rule_is_refused() -> None:
    with pytest.raises(ValidationError, match="staleness must be"):
        derive(Outer(), staleness=-1)
    with pytest.raises(ValidationError):
        derive(Outer(), staleness="many")
    with pytest.raises(ValidationError, match="Extra inputs"):
        derive(Outer(), unknown=1)
    # model_copy would have taken all three as given
    assert Outer().model_copy(update={"staleness": -1}).staleness == -1


class Named(BaseModel):
    model: str = "policy"


def test_a_field_may_be_called_model() -> None:
    assert derive(Named(), model="mine").model == "mine"


def test_no_product_code_copies_a_config_past_validation() -> None:
    root = Path(__file__).resolve().parents[2]
    folders = ("schemas", "producers", "consumers", "envs", "rollout", "trainer", "ops")
    found = [
        str(path.relative_to(root))
        for folder in folders
        for path in (root / folder).rglob("*.py")
        if "model_copy(update" in path.read_text() and path.name != "derive.py"
    ]
    assert not found, f"use schemas.derive.derive instead of model_copy(update=...): {found}"
