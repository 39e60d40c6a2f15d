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
