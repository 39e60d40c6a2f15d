"""``derive``: a config with some values changed, validated again.

Pydantic's ``model_copy(update=...)`` sets the values as given, past every field type and
validator; a role's config made from the run's shared values that way could hold what no recipe
may. ``derive`` builds the new config through the model's own validation instead, so a shared
value is checked where it lands, and the fields a recipe set stay told apart from the defaults.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def derive(model: M, /, **changes: Any) -> M:
    """``model`` with ``changes``, validated by its class (a ``ValidationError`` when a change
    breaks a field's type or a validator); the fields set are ``model``'s and the changed ones."""
    values = {name: getattr(model, name) for name in model.model_fields_set}
    return type(model).model_validate({**values, **changes})
