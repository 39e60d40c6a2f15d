"""Every key of a run config, read from the config models: the resolved values with where each
came from (``rlstream config show``) and the reference page (``rlstream config docs``, kept as
``docs/config-reference.md`` and checked against the models by the suite)."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

HEADER = """# Configuration reference

Every key of a run's recipe (TOML), generated from the config models by
`rlstream config docs --out docs/config-reference.md`; the suite checks that this page is
current. How the pieces fit: [Configuration](configuration.md).
Set a key in a recipe's table (`[learner]` then `lr = 0.001`) or on any command that takes a
recipe with `--set learner.lr=0.001`. `rlstream config show RECIPE` prints the resolved value of
every key and where it came from; `rlstream config validate RECIPE` checks a recipe.

Keys marked **local** belong to one process or host (paths, addresses, thread counts): they may
differ between a run's processes. Every other key is part of the run's config hash, which every
role checks against the run's recorded config at its start ([Configuration](configuration.md)). The shared values
at the top (`seed`, `model`, `group_size`, ...) are injected into the role sections that repeat
them; set them at the top.
"""


def _is_local(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("local"))


def _leaves(model: BaseModel, prefix: str = "", local: bool = False) -> Iterator[tuple]:
    """``(key, value, local)`` for every leaf of a config instance."""
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        key, here = f"{prefix}{name}", local or _is_local(field)
        if isinstance(value, BaseModel):
            yield from _leaves(value, f"{key}.", here)
        elif (
            isinstance(value, dict)
            and value
            and all(isinstance(v, BaseModel) for v in value.values())
        ):
            for k, v in value.items():
                yield from _leaves(v, f"{key}.{k}.", here)
        else:
            yield key, to_jsonable_python(value), here


def resolved_rows(config: BaseModel, sources: dict[str, str]) -> list[dict[str, Any]]:
    """Each key of ``config`` with its value, ``local`` flag and source: the recipe or ``--set``
    key that names it or a table above it (``sources``, from ``recipe_data``), else default."""
    rows = []
    for key, value, local in _leaves(config):
        parts = key.split(".")
        source = next(
            (
                sources[p]
                for p in (".".join(parts[:i]) for i in range(len(parts), 0, -1))
                if p in sources
            ),
            "default",
        )
        rows.append({"key": key, "value": value, "source": source, "local": local})
    return rows


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    if annotation is Ellipsis:
        return "..."
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    text = json.dumps(to_jsonable_python(value)).replace(str(Path.home()), "~")
    return text if len(text) <= 60 else text[:57] + "..."


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The config model a field holds (and whether by name, as ``dict[str, Model]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if typing.get_origin(annotation) is dict:
        value = typing.get_args(annotation)[1]
        if isinstance(value, type) and issubclass(value, BaseModel):
            return value, True
    return None, False


def _sections(model: type[BaseModel], prefix: str, local: bool) -> Iterator[tuple[str, list[str]]]:
    rows, nested = [], []
    for name, field in model.model_fields.items():
        sub, named = _model_of(field.annotation)
        here = local or _is_local(field)
        key = f"{prefix}{name}"
        if sub is not None:
            nested.append((f"{key}.NAME." if named else f"{key}.", sub, here))
            continue
        description = " ".join((field.description or "").split()).replace("|", "\\|")
        flag = " **local**" if here else ""
        rows.append(
            f"| `{key}` | {_type_name(field.annotation)} | `{_default(field)}` | {description}{flag} |"
        )
    yield prefix.rstrip(".") or "(top level)", rows
    for sub_prefix, sub, here in nested:
        yield from _sections(sub, sub_prefix, here)


def reference() -> str:
    """The Markdown reference of every key of ``RunConfig`` (see the module docstring)."""
    from rlstream.ops.run.config import RunConfig

    parts = [HEADER]
    for title, rows in _sections(RunConfig, "", False):
        if not rows:
            continue
        parts.append(f"\n## `{title}`\n\n| key | type | default | meaning |\n|---|---|---|---|\n")
        parts.append("\n".join(rows) + "\n")
    return "".join(parts)
