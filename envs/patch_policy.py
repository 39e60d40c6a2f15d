"""What a repo answer may not add: a check of the patched tree's paths before its tests run.

The verdict does not rest on this check: the tests, pytest and the outcomes live in the verdict
side of a judged run, apart from the patched package (:mod:`rlstream.envs.repo_driver`,
:mod:`rlstream.envs.repo_bridge`). It refuses, with a reason, what no fix of a package's bug
needs and what would stand in for the test machinery or an interpreter's start-up in any other
runner of the same tree (a developer's own ``pytest``): a file or folder named ``pytest*``,
``_pytest``, ``pluggy``, ``py.py``, ``*.dist-info``, ``*.egg-info``, ``*.pth``,
``sitecustomize.py`` or ``usercustomize.py`` anywhere in the tree; a file whose path runs
through another file (``pkg/__init__.py/x``). ``check`` returns the reasons, empty when the tree
is acceptable.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from rlstream.envs import sandbox

_PATH_PART = re.compile(
    r"^(pytest.*|_pytest|pluggy|py\.py|sitecustomize\.py|usercustomize\.py"
    r"|.*\.dist-info|.*\.egg-info|.*\.pth)$",
    re.IGNORECASE,
)


def check(base: Mapping[str, str], files: Mapping[str, str]) -> list[str]:
    """Why the tree ``files`` (base + the answer's patch) is refused; [] when it is not."""
    return [f"{name}: {why}" for name, why in _bad_paths(files) if name not in base]


def _bad_paths(files: Mapping[str, str]) -> Iterator[tuple[str, str]]:
    for name in sorted(files):
        parts = name.split("/")
        if any(_PATH_PART.match(part) for part in parts):
            yield name, "named like the test runner or an interpreter start-up hook"
        above = sandbox.file_above(name, files)
        if above:
            yield name, f"{above} is a file, so nothing can lie under it"
