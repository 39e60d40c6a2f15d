"""One exception root: every error class rlstream defines derives from ``RlstreamError``
(directly or through another of ours), so ``except RlstreamError`` catches every refusal and
setup failure rlstream reports on purpose, and nothing else.

The check reads the source: a class whose bases name a built-in exception must also name
``RlstreamError`` or one of our own error classes. The sandbox's standalone bootstrap keeps a
private exception (it runs with the standard library only, in its own process).
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

from rlstream.schemas.errors import Refused, RlstreamError, SetupError

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("schemas", "producers", "consumers", "envs", "rollout", "trainer", "ops")
BUILTIN_ERRORS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}
#: Modules whose own exception stays outside the root: the standalone sandbox bootstrap and the
#: private root it builds, the repo family's bridge (standard library only: they run in the
#: sandbox), vLLM's weight-transfer backend (it runs in vLLM's venv, without rlstream), and the
#: engines (their classes join the root with the engine change in progress).
EXEMPT = {
    "envs/sandbox/boot.py",
    "envs/sandbox/root.py",
    "envs/repo_bridge.py",
    "rollout/vllm_server/rlstream_vllm/backend.py",
    "rollout/engines.py",
}


def _error_classes() -> dict[str, tuple[str, list[str]]]:
    """Every class of ours that names an exception base: name -> (file, base names)."""
    out: dict[str, tuple[str, list[str]]] = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                    out[node.name] = (str(path.relative_to(ROOT)), bases)
    return out


def test_every_error_class_derives_from_the_root() -> None:
    classes = _error_classes()

    def ours(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name == "RlstreamError":
            return True
        if name not in classes or name in seen:
            return False
        return any(ours(b, seen | {name}) for b in classes[name][1])

    def is_error(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in BUILTIN_ERRORS:
            return True
        if name not in classes or name in seen:
            return False
        return any(is_error(b, seen | {name}) for b in classes[name][1])

    outside = [
        f"{path}: {name}({', '.join(bases)})"
        for name, (path, bases) in classes.items()
        if path not in EXEMPT and is_error(name) and not ours(name)
    ]
    assert not outside, "errors outside RlstreamError:\n" + "\n".join(outside)


def test_one_refused_and_one_setup_error() -> None:
    """The merged classes keep what their callers catch them by and read from them."""
    one = Refused("bad signature")
    assert (one.reason, one.record, str(one)) == ("bad signature", None, "bad signature")
    record = object()
    of_batch = Refused(record, "no such task")
    assert (of_batch.reason, of_batch.record) == ("no such task", record)
    assert isinstance(one, RlstreamError) and isinstance(one, ValueError)
    with pytest.raises(RuntimeError):
        raise SetupError("Java is missing")
    names = [n for n, (_, bases) in _error_classes().items() if n in ("Refused", "SetupError")]
    assert sorted(names) == ["Refused", "SetupError"], names
