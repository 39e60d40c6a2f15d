"""The wheel holds every module and data file of the package.

The repository root is the ``rlstream`` package and its packages are listed by hand in
``pyproject.toml``: an editable install finds a new subfolder anyway, so a folder missing from
the list would only show up as an ImportError after a real install. This test fails first.
"""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Folders of the repository that are not part of the package.
OUTSIDE = {"tests", "build", "dist", "artifacts", "results", "docs", "__pycache__"}


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_files() -> list[Path]:
    files = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(
            part in OUTSIDE or part.startswith(".") or part.endswith(".egg-info")
            for part in rel.parts
        ):
            continue
        if path.is_file() and len(rel.parts) > 1 and path.suffix not in {".pyc"}:
            files.append(rel)
    return files


def _module_dir(package: str) -> Path:
    return Path(*package.split(".")[1:])


def test_every_module_and_data_file_is_in_a_listed_package() -> None:
    setup = _setuptools()
    assert setup["package-dir"] == {"rlstream": "."}
    packages = {_module_dir(p): p for p in setup["packages"]}
    data = setup.get("package-data", {})
    missing = []
    for rel in _package_files():
        if rel.suffix == ".py":
            if rel.parent not in packages:
                missing.append(f"{rel}: its folder is not in [tool.setuptools] packages")
            continue
        # a data file belongs to the deepest listed package above it and must match its globs
        owner = max((d for d in packages if d in rel.parents), key=lambda d: len(d.parts))
        inside = rel.relative_to(owner).as_posix()
        globs = data.get(packages[owner], [])
        if not any(fnmatch.fnmatch(inside, g) for g in globs):
            missing.append(f"{rel}: not in [tool.setuptools.package-data] of {packages[owner]}")
    assert not missing, "\n".join(missing)


def test_every_listed_package_exists() -> None:
    for package in _setuptools()["packages"]:
        assert (ROOT / _module_dir(package)).is_dir(), package
