"""``derive``: a config with some values changed, validated again.

Pydantic's ``model_copy(update=...)`` sets the values as given, past every field type and
validator; a role's config made from the run's shared values that way could hold what no recipe
may. ``derive`` builds the new config through the model's own validation instead, so a shared
value is checked where it lands, and the fields a recipe set stay told apart from the defaults.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel
from pydantic.config import JsonDict
from pydantic_core import to_jsonable_python

M = TypeVar("M", bound=BaseModel)


def derive(model: M, /, **changes: Any) -> M:
    """``model`` with ``changes``, validated by its class (a ``ValidationError`` when a change
    breaks a field's type or a validator); the fields set are ``model``'s and the changed ones."""
    values = {name: getattr(model, name) for name in model.model_fields_set}
    return type(model).model_validate({**values, **changes})


#: ``Field(json_schema_extra=LOCAL)`` marks a value of one process or host (a path, an address,
#: a thread count, how many ranks) that may differ between the processes of one run: ``shared``
#: leaves it out, so what a run records and checks (``ops.run.recorded``) is only what every role
#: must agree on.
LOCAL: JsonDict = {"local": True}


def shared(model: BaseModel) -> dict[str, Any]:
    """``model`` as JSON-ready values, its ``LOCAL`` fields (at any depth) left out."""
    out: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and extra.get("local"):
            continue
        out[name] = _shared_value(getattr(model, name))
    return out


def _shared_value(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return shared(value)
    if isinstance(value, dict):
        return {str(k): _shared_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_shared_value(v) for v in value]
    return to_jsonable_python(value)
