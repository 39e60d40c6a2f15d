"""Schema evolution: every record ever written decodes with today's code.

For every frozen version under schemas/avro/history and every event, records written with that
version's schema (generated from the schema, plus golden bytes stored in tests/unit/data when
the version was frozen) must decode with today's reader schemas. Also: every schema file parses
and documents every field, history files never change, and today's schemas are frozen somewhere.

Run ``python tests/unit/test_schema_compat.py`` after freezing a new history version to write its
golden files (existing ones are never overwritten).
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import fastavro
import numpy as np
import pytest

from rlstream.schemas import arrays as A
from rlstream.schemas import events as E

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = DATA / "golden"
FROZEN = DATA / "history_sha256.json"
VERSIONS = [d.name for d in E.history_dirs()]


# --- a deterministic record generator for any schema -------------------------------------------


def example(schema: Any, named: dict[str, Any], full: bool, path: str = "r") -> Any:
    """A value conforming to ``schema``: ``full`` fills every optional part, else leaves them out."""
    if isinstance(schema, str) and schema in named:
        return example(named[schema], named, full, path)
    if isinstance(schema, list):
        branches = [b for b in schema if b != "null"] if full or "null" not in schema else ["null"]
        return example(branches[0], named, full, path)
    if isinstance(schema, dict):
        kind = schema["type"]
        if kind == "record":
            fields = [f for f in schema["fields"] if full or "default" not in f]
            return {
                f["name"]: example(f["type"], named, full, f"{path}.{f['name']}") for f in fields
            }
        if kind == "enum":
            return schema["symbols"][-1 if full else 0]
        if kind == "array":
            return [example(schema["items"], named, full, f"{path}[{i}]") for i in range(2 * full)]
        if kind == "map":
            return {
                k: example(schema["values"], named, full, f"{path}.{k}") for k in "ab"[: 2 * full]
            }
        return example(kind, named, full, path)
    primitives = {
        "null": None,
        "boolean": True,
        "int": len(path),
        "long": 2**40 + len(path),
        "float": 0.5,
        "double": 0.25 + len(path),
        "bytes": path.encode()[-8:],
        "string": f"s:{path}",
    }
    return primitives[schema]


def write_with(schema: dict[str, Any], record: dict[str, Any]) -> bytes:
    """Encode ``record`` as an old writer would: header with that schema's fingerprint + body."""
    out = io.BytesIO()
    out.write(E.MAGIC + E.fingerprint(schema))
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


def written(data: bytes, schema: dict[str, Any]) -> Any:
    """What the writer wrote, read back with the writer schema alone (defaults filled in)."""
    buf = io.BytesIO(data)
    buf.seek(E.HEADER_SIZE)
    return fastavro.schemaless_reader(buf, fastavro.parse_schema(schema), None)


def assert_preserved(resolved: Any, original: Any, path: str = "record") -> None:
    """Every value the writer wrote survives resolution; fields the reader lacks may be dropped."""
    if isinstance(original, dict) and isinstance(resolved, dict):
        for key, value in original.items():
            if key in resolved:
                assert_preserved(resolved[key], value, f"{path}.{key}")
    elif isinstance(original, list) and isinstance(resolved, list):
        assert len(resolved) == len(original), path
        for i, (r, o) in enumerate(zip(resolved, original, strict=True)):
            assert_preserved(r, o, f"{path}[{i}]")
    else:
        assert resolved == original, f"{path}: {resolved!r} != {original!r}"


def old_schemas() -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (version, event, schema)
        for version, directory in ((d.name, d) for d in E.history_dirs())
        for event, schema in E.load_event_schemas(directory).items()
    ]


OLD = [pytest.param(v, e, s, id=f"{v}-{e}") for v, e, s in old_schemas()]


# --- the tests ---------------------------------------------------------------------------------


def test_there_is_a_history() -> None:
    assert VERSIONS and VERSIONS[0] == "v1"
    first = E.load_event_schemas(E.history_dirs()[0])
    assert set(first) <= set(E.EVENTS), "an event is added, never removed"
    assert set(E.load_event_schemas(E.history_dirs()[-1])) == set(E.EVENTS)


@pytest.mark.parametrize(("version", "event", "schema"), OLD)
@pytest.mark.parametrize("full", [True, False], ids=["full", "minimal"])
def test_old_records_decode_with_todays_reader(
    version: str, event: str, schema: dict[str, Any], full: bool
) -> None:
    parsed = fastavro.parse_schema(schema)
    record = example(parsed, parsed["__named_schemas"], full)
    data = write_with(schema, record)
    decoded = E.decode(data, expect=event)
    assert decoded.event == event
    assert decoded.fingerprint == E.fingerprint(schema)
    assert_preserved(decoded.record, written(data, schema))
    # the reader's fields are all there, new ones with their defaults
    _, reader = E.default_store().current(event)
    assert set(decoded.record) == {f["name"] for f in reader["fields"]}


@pytest.mark.parametrize(("version", "event", "schema"), OLD)
def test_golden_bytes_decode(version: str, event: str, schema: dict[str, Any]) -> None:
    path = GOLDEN / version / f"{event}.bin"
    assert path.exists(), f"missing golden file {path}: run python {__file__}"
    data = path.read_bytes()
    assert E.fingerprint_of(data) == E.fingerprint(schema)
    decoded = E.decode(data, expect=event)
    assert_preserved(decoded.record, written(data, schema))


def test_history_files_are_frozen() -> None:
    recorded = json.loads(FROZEN.read_text())
    on_disk = {
        d.name: {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.avsc"))
        }
        for d in E.history_dirs()
    }
    assert on_disk == recorded, (
        "history/ files changed or a version is not recorded; history is append-only: "
        f"add a new version and record its hashes in {FROZEN}"
    )


def test_store_holds_every_history_fingerprint() -> None:
    store = E.default_store()
    for _, event, schema in old_schemas():
        fp = E.fingerprint(schema)
        assert fp in store
        assert store.name_of(fp) == E.EVENTS[event]


def test_current_schemas_are_frozen_in_history() -> None:
    """A schema change must be snapshotted as a new history version before it ships."""
    history = {E.fingerprint(schema) for _, _, schema in old_schemas()}
    for event in E.EVENTS:
        fp, _ = E.default_store().current(event)
        assert fp in history, f"{event}: current schema not in history/; copy it to a new vN"


def _walk_named(schema: Any) -> list[dict[str, Any]]:
    if isinstance(schema, list):
        return [n for branch in schema for n in _walk_named(branch)]
    if not isinstance(schema, dict):
        return []
    found = [schema] if schema.get("type") in ("record", "enum", "fixed") else []
    for field in schema.get("fields", []):
        found += _walk_named(field["type"])
    for key in ("items", "values"):
        found += _walk_named(schema.get(key))
    return found


@pytest.mark.parametrize("directory", [E.SCHEMA_DIR, *E.history_dirs()], ids=lambda d: d.name)
def test_schema_files_parse_and_document_every_field(directory: Path) -> None:
    files = sorted(directory.glob("*.avsc"))
    assert files
    for path in files:
        schema = json.loads(path.read_text())
        assert schema["namespace"] == "rlstream", path
        assert path.stem == schema["name"], f"{path}: one named type per file, named like it"
        for named in _walk_named(schema):
            assert named.get("doc"), f"{path}: {named['name']} has no doc"
            for field in named.get("fields", []):
                assert field.get("doc"), f"{path}: field {named['name']}.{field['name']} has no doc"
    for schema in E.load_event_schemas(directory).values():
        fastavro.parse_schema(schema)  # self-contained once expanded


def test_evolution_rules_hold_for_a_simulated_release() -> None:
    """What the history test guards: added fields need defaults, removed ones are skipped."""
    store = E.SchemaStore(history=False)
    task = E.load_event_schemas()["task"]
    older = {**task, "fields": [f for f in task["fields"] if f["name"] != "attempt"]}
    newer = {**task, "fields": [*task["fields"], {"name": "future", "type": "string"}]}
    parsed_old = fastavro.parse_schema(older)
    record = example(parsed_old, parsed_old["__named_schemas"], True)
    store.add(json.dumps(older))
    decoded = E.deserializer(store)(write_with(older, record), None)
    assert decoded.record["attempt"] == 0  # the reader's default
    store.add(newer)
    decoded = E.deserializer(store)(
        write_with(newer, {**record, "attempt": 2, "future": "x"}), None
    )
    assert "future" not in decoded.record and decoded.record["attempt"] == 2
    broken = {**task, "fields": [f for f in task["fields"] if f["name"] != "seed"]}
    store.add(broken)
    parsed_broken = fastavro.parse_schema(broken)
    data = write_with(broken, example(parsed_broken, parsed_broken["__named_schemas"], True))
    with pytest.raises(E.DecodeError) as info:
        E.deserializer(store)(data, None)
    assert info.value.reason == "incompatible_schema"


ROUTE_CARRIERS = ("trajectory", "admission", "feedback")


@pytest.mark.parametrize("event", ROUTE_CARRIERS)
def test_routes_written_before_expert_bytes_read_as_uint8(event: str) -> None:
    """A v4 writer had no ``expert_bytes``: its routes are uint8 and must still read so."""
    schema = E.load_event_schemas(E.HISTORY_DIR / "v4")[event]
    parsed = fastavro.parse_schema(schema)
    record = example(parsed, parsed["__named_schemas"], True)
    routes = np.array([[[0, 255], [128, 7]], [[200, 1], [3, 254]], [[9, 8], [250, 251]]], np.uint8)
    fields = A.pack_tokens([5, 6, 7], [0.0, -0.5, -0.25], [0, 1, 1], routes)
    assert fields.pop("expert_bytes") == 1  # a v4 record has the same bytes, without the field
    carriers = record["samples"] if event == "admission" else [record]
    for carrier in carriers:
        carrier.update(fields)
    decoded = E.decode(write_with(schema, record), expect=event).record
    for carrier in decoded["samples"] if event == "admission" else [decoded]:
        assert carrier["expert_bytes"] == 1
        got = A.unpack_tokens(carrier).routed_experts
        assert got.dtype == np.uint8 and np.array_equal(got, routes)


def write_golden() -> None:
    """Write golden files and hash records for versions that lack them; never overwrite."""
    recorded = json.loads(FROZEN.read_text()) if FROZEN.exists() else {}
    for version, event, schema in old_schemas():
        path = GOLDEN / version / f"{event}.bin"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            parsed = fastavro.parse_schema(schema)
            path.write_bytes(write_with(schema, example(parsed, parsed["__named_schemas"], True)))
            print("wrote", path)
    for directory in E.history_dirs():
        if directory.name not in recorded:
            recorded[directory.name] = {
                p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(directory.glob("*.avsc"))
            }
    FROZEN.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    write_golden()
