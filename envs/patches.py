"""Unified diffs of a workspace held by value (path -> text): make one, read one, apply one.

Rules:

- ``diff(base, files)`` is the ``git diff``-shaped unified diff (``--- a/PATH``, ``+++ b/PATH``,
  three lines of context) that turns ``base`` into ``files``, files in path order; a new file
  comes from ``/dev/null``, a removed one goes to it; a last line without a newline is marked
  ``\\ No newline at end of file``. ``apply(base, diff(base, files)) == files`` for every pair.
- ``apply(files, patch)`` applies every hunk exactly (an empty patch changes nothing) (each hunk's context and removed lines must
  match, at its stated line or, failing that, at the nearest line where they do), or raises
  :class:`PatchError` saying which file and hunk did not apply; nothing is half-applied (the
  input is never changed; a new mapping is returned).
- Paths: ``a/`` and ``b/`` prefixes are dropped; a path that is absolute, climbs (``..``), or
  is not a workspace name (``sandbox.check_name``) is refused with ``PatchError`` whose
  ``outside`` is true: a patch never reaches outside the repository.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from rlstream.envs import sandbox
from rlstream.schemas.errors import RlstreamError

NO_NEWLINE = "\\ No newline at end of file"
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(RlstreamError, ValueError):
    """A patch that cannot be applied; ``outside``: it names a path outside the repository."""

    def __init__(self, message: str, outside: bool = False) -> None:
        super().__init__(message)
        self.outside = outside


@dataclass
class FilePatch:
    """The hunks of one file: ``old``/``new`` paths (None: ``/dev/null``)."""

    old: str | None
    new: str | None
    hunks: list[tuple[int, list[str]]] = field(default_factory=list)  # (old start, lines)


def _lines(text: str) -> list[str]:
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n" + NO_NEWLINE + "\n"
    return lines


def diff(base: dict[str, str], files: dict[str, str]) -> str:
    """The unified diff from ``base`` to ``files`` (module rules)."""
    out: list[str] = []
    for path in sorted(set(base) | set(files)):
        old, new = base.get(path), files.get(path)
        if old == new:
            continue
        a = f"a/{path}" if old is not None else "/dev/null"
        b = f"b/{path}" if new is not None else "/dev/null"
        body = list(difflib.unified_diff(_lines(old or ""), _lines(new or ""), a, b, n=3))
        out += body or [f"--- {a}\n", f"+++ {b}\n"]  # an empty file made or removed
    return "".join(out)


def _path(raw: str) -> str | None:
    name = raw.split("\t")[0].strip()
    if name == "/dev/null":
        return None
    if name[:2] in ("a/", "b/"):
        name = name[2:]
    try:
        return sandbox.check_name(name)
    except ValueError:
        raise PatchError(f"patch touches {name!r}, outside the repository", True) from None


def parse(patch: str) -> list[FilePatch]:
    """The files and hunks of ``patch``; PatchError for a malformed one."""
    files: list[FilePatch] = []
    lines = patch.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            files.append(FilePatch(_path(line[4:]), _path(lines[i + 1][4:])))
            i += 2
            continue
        m = _HUNK.match(line)
        if m is None:
            i += 1  # headers git writes (diff --git, index ...) and free text are skipped
            continue
        if not files:
            raise PatchError(f"line {i + 1}: a hunk before any ---/+++ file header")
        n_old = int(m.group(2)) if m.group(2) is not None else 1
        n_new = int(m.group(4)) if m.group(4) is not None else 1
        body, i = _hunk_body(lines, i + 1, n_old, n_new)
        files[-1].hunks.append((int(m.group(1)), body))
    if not files and patch.strip():
        raise PatchError("no file in the patch (expected ---/+++ headers and @@ hunks)")
    return files


def _hunk_body(lines: list[str], i: int, n_old: int, n_new: int) -> tuple[list[str], int]:
    body: list[str] = []
    while (n_old > 0 or n_new > 0) and i < len(lines):
        line = lines[i] or " "  # an empty context line may lose its space in transit
        tag = line[0]
        if tag not in " +-\\":
            raise PatchError(f"line {i + 1}: {line[:40]!r} is not a hunk line")
        body.append(line)
        n_old -= tag in " -"
        n_new -= tag in " +"
        i += 1
    if n_old > 0 or n_new > 0:
        raise PatchError("the patch ends inside a hunk")
    while i < len(lines) and lines[i].startswith("\\"):
        body.append(lines[i])
        i += 1
    return body, i


def _sides(body: list[str]) -> tuple[list[str], list[str]]:
    """The hunk's old and new lines, each with its newline (none where the marker says)."""
    old: list[str] = []
    new: list[str] = []
    for k, line in enumerate(body):
        if line[0] == "\\":
            continue
        text = line[1:] + ("" if k + 1 < len(body) and body[k + 1][0] == "\\" else "\n")
        if line[0] in " -":
            old.append(text)
        if line[0] in " +":
            new.append(text)
    return old, new


def _find(lines: list[str], old: list[str], start: int) -> int:
    """Where ``old`` matches ``lines``: at ``start`` or the nearest place; -1 when nowhere."""
    for delta in range(len(lines) + 1):
        for at in (start - delta, start + delta):
            if 0 <= at <= len(lines) - len(old) and lines[at : at + len(old)] == old:
                return at
    return -1


def apply(files: dict[str, str], patch: str) -> dict[str, str]:
    """``files`` with ``patch`` applied (module rules); PatchError when it does not apply."""
    out = dict(files)
    for fp in parse(patch):
        path = fp.new or fp.old
        assert path is not None
        if fp.old is None and path in out:
            raise PatchError(f"{path}: the patch creates it, but it exists")
        if fp.old is not None and fp.old not in out:
            raise PatchError(f"{fp.old}: no such file")
        lines = out.get(fp.old or "", "").splitlines(keepends=True) if fp.old else []
        offset = 0
        for n, (start, body) in enumerate(fp.hunks, 1):
            old, new = _sides(body)
            at = _find(lines, old, max(0, start - 1 + offset) if old else start + offset)
            if at < 0:
                raise PatchError(f"{path}: hunk {n} (line {start}) does not apply")
            lines[at : at + len(old)] = new
            offset += len(new) - len(old)
        if fp.old is not None and fp.new != fp.old:
            del out[fp.old]
        if fp.new is not None:
            out[fp.new] = "".join(lines)
    return out


def touched(patch: str) -> list[str]:
    """Every path ``patch`` names (old and new), in order; PatchError as ``parse``."""
    names: list[str] = []
    for fp in parse(patch):
        names += [p for p in (fp.old, fp.new) if p is not None and p not in names]
    return names
