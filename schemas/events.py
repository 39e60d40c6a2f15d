"""The event codec: Avro schemas, the wire format, and a store of every writer schema ever used.

Every record value is the Avro single-object encoding (magic ``c3 01``, the writer schema's
CRC-64-AVRO fingerprint, the Avro binary record), so any Avro library can read it.

Guarantees:
- a record is validated before it is encoded; unknown fields are an error;
- a record is decoded with the writer schema its fingerprint names, resolved against today's
  reader schema; anything undecodable raises ``DecodeError`` with a dead-letter reason;
- schemas are parsed once per process (``default_store``).

Evolution rules: only add fields with a default, or remove fields that had one; never rename or
retype; copy ``schemas/avro/*.avsc`` to a new ``history/vN+1/`` before a changed schema ships.
Details: docs/streams.md (The event codec).
"""

from __future__ import annotations

import functools
import io
import json
import numbers
import reprlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import fastavro
import fastavro.schema

from .errors import RlstreamError

MAGIC = b"\xc3\x01"
FINGERPRINT_SIZE = 8
HEADER_SIZE = len(MAGIC) + FINGERPRINT_SIZE
NAMESPACE = "rlstream"
SCHEMA_DIR = Path(__file__).resolve().parent / "avro"
HISTORY_DIR = SCHEMA_DIR / "history"

EVENTS: Mapping[str, str] = MappingProxyType(
    {
        "task": "rlstream.Task",
        "trajectory": "rlstream.Trajectory",
        "reward": "rlstream.Reward",
        "admission": "rlstream.AdmissionDecision",
        "weight_manifest": "rlstream.WeightManifest",
        "weight_chunk": "rlstream.WeightChunk",
        "feedback": "rlstream.Feedback",
        "run_manifest": "rlstream.RunManifest",
        "dead_letter": "rlstream.DeadLetter",
        "eval": "rlstream.Eval",
        "forget_audit": "rlstream.ForgetAudit",
        "capacity": "rlstream.Capacity",
        "preempted": "rlstream.Preempted",
    }
)
"""Short event name -> Avro full name of its record type."""

_EVENT_BY_NAME = {name: event for event, name in EVENTS.items()}
_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
_NAMED_KINDS = frozenset({"record", "error", "enum", "fixed"})
_INT_RANGE = {"int": (-(2**31), 2**31 - 1), "long": (-(2**63), 2**63 - 1)}
_short = reprlib.Repr()
_short.maxstring = 40
_short.maxother = 40

ParsedSchema = Any  # fastavro's parsed form: dicts, lists and names, opaque to callers
Serializer = Callable[..., bytes]


class EventError(RlstreamError, ValueError):
    """A record does not fit its schema, or a schema is unusable.

    ``reason`` is a ``DeadLetter.reason`` symbol, so a consumer can route the failure as is.
    """

    def __init__(self, message: str, reason: str = "invalid_record") -> None:
        super().__init__(message)
        self.reason = reason


class DecodeError(EventError):
    """Bytes that are not a decodable rlstream record.

    ``reason``: ``bad_header`` (too short, wrong magic, tombstone), ``unknown_schema`` (fingerprint
    not in the store), ``incompatible_schema`` (writer cannot be resolved to today's reader),
    ``unexpected_event`` (a valid record of another event type), ``corrupt_body`` (truncated,
    trailing bytes or undecodable body).
    """


@dataclass(frozen=True, slots=True)
class Decoded:
    """One decoded record value.

    ``event`` is the short event name (the Avro full name for a record type this code does not
    know, decoded with its writer schema); ``record`` follows today's schema for known events.
    """

    event: str
    name: str
    fingerprint: bytes
    record: dict[str, Any]


# --- schema files ---------------------------------------------------------------------------


def _full_name(schema: Mapping[str, Any]) -> str:
    name = str(schema["name"])
    return name if "." in name else f"{schema.get('namespace', NAMESPACE)}.{name}"


def load_named_types(directory: Path) -> dict[str, dict[str, Any]]:
    """Read every ``*.avsc`` of ``directory``: full name -> schema JSON (one named type per file)."""
    types: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.avsc")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        name = _full_name(schema)
        if name in types:
            raise EventError(f"{path}: type {name} is defined twice", reason="other")
        types[name] = schema
    return types


def _expand(schema: Any, types: Mapping[str, Any], seen: set[str]) -> Any:
    """Inline references to types of other files, at first use only (Avro forbids redefinition)."""
    if isinstance(schema, str):
        if schema in _PRIMITIVES or schema in seen or schema not in types:
            return schema
        return _expand(types[schema], types, seen)
    if isinstance(schema, list):
        return [_expand(branch, types, seen) for branch in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    kind = schema.get("type")
    if kind in _NAMED_KINDS:
        seen.add(_full_name(schema))
    if kind in ("record", "error"):
        out["fields"] = [{**f, "type": _expand(f["type"], types, seen)} for f in schema["fields"]]
    elif kind == "array":
        out["items"] = _expand(schema["items"], types, seen)
    elif kind == "map":
        out["values"] = _expand(schema["values"], types, seen)
    elif not isinstance(kind, str) or kind not in _PRIMITIVES:
        out["type"] = _expand(kind, types, seen)
    return out


def load_event_schemas(directory: Path = SCHEMA_DIR) -> dict[str, dict[str, Any]]:
    """Self-contained schema JSON of every event defined in ``directory``, by short event name.

    Events whose file is absent (a history version older than the event) are left out.
    """
    types = load_named_types(directory)
    return {
        event: _expand(types[name], types, set()) for event, name in EVENTS.items() if name in types
    }


def history_dirs() -> list[Path]:
    """The frozen schema versions under ``schemas/avro/history``, oldest first (v1, v2, ...)."""
    dirs = [d for d in HISTORY_DIR.glob("v*") if d.is_dir() and d.name[1:].isdigit()]
    return sorted(dirs, key=lambda d: int(d.name[1:]))


def canonical_form(schema: Any) -> str:
    """Parsing Canonical Form of a schema (Avro spec): what the fingerprint is computed over."""
    return str(fastavro.schema.to_parsing_canonical_form(schema))


def fingerprint(schema: Any) -> bytes:
    """CRC-64-AVRO fingerprint of the schema's canonical form, 8 bytes little-endian."""
    return bytes.fromhex(fastavro.schema.fingerprint(canonical_form(schema), "CRC-64-AVRO"))


# --- the store ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    canonical: str
    parsed: ParsedSchema


class SchemaStore:
    """Writer schemas by fingerprint, plus today's reader schema of every event.

    The store always holds the current schemas (they are the readers); ``history=True`` adds every
    frozen version under ``schemas/avro/history``. ``add`` registers schemas learned at run time
    (from the ``rl.schemas`` topic). Safe to share between threads.
    """

    def __init__(self, *, schema_dir: Path = SCHEMA_DIR, history: bool = True) -> None:
        self._entries: dict[bytes, _Entry] = {}
        self._current: dict[str, bytes] = {}
        self._readers: dict[str, ParsedSchema] = {}
        self._lock = threading.Lock()
        for event, schema in load_event_schemas(schema_dir).items():
            fp = self.add(schema)
            self._current[event] = fp
            self._readers[EVENTS[event]] = self._entries[fp].parsed
        for directory in history_dirs() if history else ():
            for schema in load_event_schemas(directory).values():
                self.add(schema)

    def add(self, schema_json: str | Mapping[str, Any]) -> bytes:
        """Register a writer schema (JSON text or parsed JSON); returns its fingerprint."""
        try:
            schema = json.loads(schema_json) if isinstance(schema_json, str) else schema_json
            canonical = canonical_form(schema)
            fp = bytes.fromhex(fastavro.schema.fingerprint(canonical, "CRC-64-AVRO"))
            if fp in self._entries:
                return fp
            parsed = fastavro.parse_schema(dict(schema) if isinstance(schema, Mapping) else schema)
        except (ValueError, TypeError, KeyError, fastavro.schema.SchemaParseException) as exc:
            raise EventError(f"unusable Avro schema: {exc}", reason="other") from exc
        name = parsed.get("name", "") if isinstance(parsed, dict) else str(parsed)
        with self._lock:
            self._entries.setdefault(fp, _Entry(name, canonical, parsed))
        return fp

    def add_record(self, key: bytes | str, value: bytes | str) -> bytes:
        """Register one ``rl.schemas`` record, checking that its key is its value's fingerprint."""
        fp = self.add(value.decode("utf-8") if isinstance(value, bytes) else value)
        key_hex = key.decode("ascii") if isinstance(key, bytes) else key
        if key_hex != fp.hex():
            raise EventError(
                f"rl.schemas key {key_hex} is not the fingerprint {fp.hex()} of its value"
            )
        return fp

    def current(self, event: str) -> tuple[bytes, ParsedSchema]:
        """Fingerprint and parsed schema that today's code writes ``event`` records with."""
        if event not in self._current:
            raise EventError(f"unknown event {event!r}; known: {sorted(self._current)}", "other")
        fp = self._current[event]
        return fp, self._entries[fp].parsed

    def get(self, fingerprint: bytes) -> ParsedSchema | None:
        """Parsed writer schema with this fingerprint, or None if the store never saw it."""
        entry = self._entries.get(bytes(fingerprint))
        return None if entry is None else entry.parsed

    def name_of(self, fingerprint: bytes) -> str | None:
        """Avro full name of the schema with this fingerprint, or None."""
        entry = self._entries.get(bytes(fingerprint))
        return None if entry is None else entry.name

    def canonical(self, fingerprint: bytes) -> str | None:
        """Canonical schema JSON with this fingerprint (the rl.schemas record value), or None."""
        entry = self._entries.get(bytes(fingerprint))
        return None if entry is None else entry.canonical

    def reader(self, name: str) -> ParsedSchema | None:
        """Today's reader schema for an Avro full name, or None for a type this code lacks."""
        return self._readers.get(name)

    def is_current(self, fingerprint: bytes) -> bool:
        """True if records with this fingerprint need no schema resolution."""
        return fingerprint in self._current.values()

    def records(self) -> Iterator[tuple[str, str]]:
        """(fingerprint hex, canonical schema JSON) of every schema, for the rl.schemas topic."""
        for fp, entry in sorted(self._entries.items()):
            yield fp.hex(), entry.canonical

    def fingerprints(self) -> frozenset[bytes]:
        """Every fingerprint in the store."""
        return frozenset(self._entries)

    def __contains__(self, fingerprint: object) -> bool:
        return fingerprint in self._entries

    def __len__(self) -> int:
        return len(self._entries)


@functools.cache
def default_store() -> SchemaStore:
    """The process-wide store: current and history schemas, parsed once on first use."""
    return SchemaStore()


# --- validation -----------------------------------------------------------------------------


def _describe(schema: Any) -> str:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, list):
        return "one of [" + ", ".join(_describe(s) for s in schema) + "]"
    return str(schema.get("name", schema.get("type")))


def _primitive_problem(datum: Any, kind: str, path: str) -> str | None:
    ok: bool
    if kind == "null":
        ok = datum is None
    elif kind == "boolean":
        # numpy's bool is no subclass of bool; matched by name to keep numpy out of this module
        ok = isinstance(datum, bool) or (
            type(datum).__module__ == "numpy" and type(datum).__name__ in ("bool", "bool_")
        )
    elif kind in _INT_RANGE:
        low, high = _INT_RANGE[kind]
        # type() first: the ABC check is the slow path (numpy integers, other Integrals)
        ok = type(datum) is int or (
            isinstance(datum, numbers.Integral) and not isinstance(datum, bool)
        )
        if ok and not low <= int(datum) <= high:
            return f"{path}: {datum} is out of range for Avro {kind}"
    elif kind in ("float", "double"):
        ok = type(datum) in (float, int) or (
            isinstance(datum, numbers.Real) and not isinstance(datum, bool)
        )
    elif kind == "bytes":
        ok = isinstance(datum, bytes | bytearray | memoryview)
    elif kind == "string":
        ok = isinstance(datum, str)
    else:
        return f"{path}: schema names unknown type {kind!r}"
    if ok:
        return None
    return f"{path}: expected {kind}, got {type(datum).__name__} {_short.repr(datum)}"


_FIELD_NAMES: dict[int, tuple[Any, frozenset[str]]] = {}


def _field_names(fields: list[Mapping[str, Any]]) -> frozenset[str]:
    """The names of a record schema's ``fields``, computed once per parsed schema."""
    hit = _FIELD_NAMES.get(id(fields))
    if hit is None or hit[0] is not fields:  # the list itself is kept, so its id is never reused
        hit = _FIELD_NAMES[id(fields)] = (fields, frozenset(f["name"] for f in fields))
    return hit[1]


def _record_problem(datum: Any, schema: Mapping[str, Any], named: Any, path: str) -> str | None:
    if not isinstance(datum, Mapping):
        return f"{path}: expected a {schema['name']} record (a mapping), got {type(datum).__name__}"
    fields = schema["fields"]
    unknown = set(datum) - _field_names(fields)
    if unknown:
        return f"{path}: unknown field(s) {sorted(map(str, unknown))} for {schema['name']}"
    for field in fields:
        name = field["name"]
        if name not in datum:
            if "default" in field:
                continue
            return f"{path}.{name}: missing required field"
        problem = _problem(datum[name], field["type"], named, f"{path}.{name}")
        if problem:
            return problem
    return None


def _union_problem(datum: Any, branches: list[Any], named: Any, path: str) -> str | None:
    """None at the first branch ``datum`` conforms to; a message is built only when none does
    (validation runs on every record written, so the common case must stay cheap)."""
    if datum is None and "null" in branches:
        return None
    real = []
    for branch in branches:
        if branch == "null":
            continue  # datum is not None here, or "null" is absent
        problem = _problem(datum, branch, named, path)
        if problem is None:
            return None
        real.append(problem)
    if datum is not None and len(real) == 1:
        return real[0]
    return f"{path}: {_short.repr(datum)} matches none of {_describe(branches)}"


def _problem(datum: Any, schema: Any, named: Mapping[str, Any], path: str) -> str | None:
    """First way ``datum`` violates ``schema`` (a parsed schema), or None if it conforms."""
    if isinstance(schema, str):
        if schema in named:
            return _problem(datum, named[schema], named, path)
        return _primitive_problem(datum, schema, path)
    if isinstance(schema, list):
        return _union_problem(datum, schema, named, path)
    kind = schema["type"]
    if kind in ("record", "error"):
        return _record_problem(datum, schema, named, path)
    if kind == "enum":
        if isinstance(datum, str) and datum in schema["symbols"]:
            return None
        return f"{path}: {_short.repr(datum)} is not one of {schema['symbols']}"
    if kind == "array":
        if not isinstance(datum, list | tuple):
            return f"{path}: expected an array (list), got {type(datum).__name__}"
        problems = (
            _problem(v, schema["items"], named, f"{path}[{i}]") for i, v in enumerate(datum)
        )
        return next((p for p in problems if p), None)
    if kind == "map":
        if not isinstance(datum, Mapping) or not all(isinstance(k, str) for k in datum):
            return f"{path}: expected a map with string keys, got {_short.repr(datum)}"
        problems = (
            _problem(v, schema["values"], named, f"{path}[{k!r}]") for k, v in datum.items()
        )
        return next((p for p in problems if p), None)
    if kind == "fixed":
        if isinstance(datum, bytes | bytearray) and len(datum) == schema["size"]:
            return None
        return f"{path}: expected {schema['size']} bytes, got {_short.repr(datum)}"
    return _problem(datum, kind, named, path)


def validate(event: str, record: Any, store: SchemaStore | None = None) -> None:
    """Raise ``EventError`` naming the first offending field if ``record`` is not a valid ``event``."""
    _, schema = (store or default_store()).current(event)
    problem = _problem(record, schema, schema.get("__named_schemas", {}), event)
    if problem:
        raise EventError(f"invalid {event} record: {problem}")


# --- serializer / deserializer -------------------------------------------------------------


def serializer(
    event: str, store: SchemaStore | None = None, *, validate: bool = True
) -> Serializer:
    """A confluent-kafka style serializer ``(value, ctx) -> bytes`` for ``event`` records.

    Rule: the value is validated against today's schema (``EventError`` names the field), then
    written as header + Avro binary body. ``validate=False`` skips the first step, for records
    that code builds from input validated already, in a shape a test checks against the schema
    (the feedback service's: there the walk over the record cost 7% of the service's CPU per
    request); fastavro still refuses a value of the wrong type (``EventError``), but not an
    unknown field.
    """
    fp, schema = (store or default_store()).current(event)
    header = MAGIC + fp
    named = schema.get("__named_schemas", {})

    def serialize(value: Mapping[str, Any], ctx: object | None = None) -> bytes:
        problem = _problem(value, schema, named, event) if validate else None
        if problem:
            raise EventError(f"invalid {event} record: {problem}")
        out = io.BytesIO()
        out.write(header)
        try:
            fastavro.schemaless_writer(out, schema, value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise EventError(f"invalid {event} record: {exc}") from exc
        return out.getvalue()

    return serialize


def fingerprint_of(data: bytes | bytearray | memoryview | None) -> bytes | None:
    """The writer fingerprint named by a record value, or None if it has no rlstream header."""
    if data is None or len(data) < HEADER_SIZE or bytes(data[: len(MAGIC)]) != MAGIC:
        return None
    return bytes(data[len(MAGIC) : HEADER_SIZE])


def _header(data: Any) -> bytes:
    if data is None:
        raise DecodeError("no value (a tombstone) where a record was expected", "bad_header")
    fp = fingerprint_of(data)
    if fp is None:
        head = bytes(data[: len(MAGIC)]).hex() if len(data) else "empty"
        raise DecodeError(
            f"not an rlstream record: {len(data)} bytes, starts with {head} "
            f"(expected magic {MAGIC.hex()} and a {HEADER_SIZE}-byte header)",
            "bad_header",
        )
    return fp


def _read_body(data: Any, writer: ParsedSchema, reader: ParsedSchema | None, what: str) -> Any:
    buf = io.BytesIO(data)
    buf.seek(HEADER_SIZE)
    try:
        record = fastavro.schemaless_reader(buf, writer, reader)
    except Exception as exc:  # fastavro raises many types on bad input; all mean one thing here
        incompatible = type(exc).__name__ == "SchemaResolutionError"
        reason = "incompatible_schema" if incompatible else "corrupt_body"
        detail = str(exc) or "the body ends early (truncated)"
        raise DecodeError(f"cannot decode {what}: {type(exc).__name__}: {detail}", reason) from exc
    if buf.tell() != len(data):
        extra = len(data) - buf.tell()
        raise DecodeError(
            f"cannot decode {what}: {extra} trailing bytes after the body", "corrupt_body"
        )
    return record


def _expected(expect: str | Iterable[str] | None) -> frozenset[str]:
    names = frozenset([expect] if isinstance(expect, str) else (expect or ()))
    unknown = names - set(EVENTS)
    if unknown:
        raise EventError(f"unknown event(s) {sorted(unknown)}; known: {sorted(EVENTS)}", "other")
    return names


def deserializer(
    store: SchemaStore | None = None, expect: str | Iterable[str] | None = None
) -> Callable[..., Decoded]:
    """A confluent-kafka style deserializer ``(data, ctx) -> Decoded``.

    Rule: the header's fingerprint selects the writer schema from ``store``; the body is resolved
    against today's reader schema of that record type. With ``expect``, a record of any other
    event raises ``DecodeError(reason="unexpected_event")``. Every failure is a ``DecodeError``.
    """
    store = store or default_store()
    expected = _expected(expect)

    def deserialize(data: bytes, ctx: object | None = None) -> Decoded:
        fp = _header(data)
        writer = store.get(fp)
        if writer is None:
            raise DecodeError(f"unknown writer schema fingerprint {fp.hex()}", "unknown_schema")
        name = store.name_of(fp) or ""
        event = _EVENT_BY_NAME.get(name, name)
        if expected and event not in expected:
            raise DecodeError(
                f"expected {'/'.join(sorted(expected))} record, got {event}", "unexpected_event"
            )
        reader = None if store.is_current(fp) else store.reader(name)
        record = _read_body(data, writer, reader, f"{event} record (schema {fp.hex()})")
        return Decoded(event=event, name=name, fingerprint=fp, record=record)

    return deserialize


@functools.cache
def _default_serializer(event: str) -> Serializer:
    return serializer(event)


def encode(event: str, record: Mapping[str, Any]) -> bytes:
    """Encode one record with the default store (see ``serializer``)."""
    return _default_serializer(event)(record, None)


def decode(data: bytes, expect: str | Iterable[str] | None = None) -> Decoded:
    """Decode one record value with the default store (see ``deserializer``)."""
    return deserializer(expect=expect)(data, None)
