"""The documentation site builds with ``mkdocs build --strict``: a link from one page to a
page or heading that does not exist fails the suite, so links cannot rot as pages move."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_docs_build_strict(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_links_resolve() -> None:
    """The README is not part of the site; its links to pages and results are checked here."""
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(((?:docs|results)/[^)#]+)", readme)
    assert targets
    missing = sorted({t for t in targets if not (ROOT / t).is_file()})
    assert not missing, missing


def test_every_source_path_the_docs_name_exists() -> None:
    """A file path in backticks (``producers/client/producer.py``) in the README or a docs page
    names a file of this repository (pages name placeholders in capitals, ``bench-NAME.json``)."""
    root = Path(__file__).resolve().parents[2]
    tops = ("producers", "consumers", "schemas", "trainer", "rollout", "envs", "ops", "tests")
    found = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|toml|md|jsonl|json|sh|avsc))`")
    stale = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for path in found.findall(page.read_text()):
            ours = path.split("/")[0] in (*tops, "docs", "results") and "NAME" not in path
            if ours and not (root / path).exists():
                stale.append(f"{page.name}: {path}")
    assert not stale, stale
