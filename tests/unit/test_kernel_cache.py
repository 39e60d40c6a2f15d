"""The numba kernels are rebuilt when a file they include changes: numba keys a kernel's cache
on its own file only, so without ``kernels.fresh_cache`` a kernel that calls a helper of another
module keeps the old helper compiled in (the control below shows the trap)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

KERNEL = (
    "import numba\nfrom .helper import h\n\n\n@numba.njit(cache=True)\ndef k(x):\n    return h(x)\n"
)
INIT = (
    "from pathlib import Path\n\n"
    "from rlstream.schemas.deltacodec.kernels import fresh_cache\n\n"
    "FRESH = {fresh}\nif FRESH:\n    fresh_cache(Path(__file__).parent)\n"
)


def _answer(root: Path, package: str) -> str:
    code = f"from {package}.kern import k; print(k(1))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _package(root: Path, name: str, fresh: bool, add: int) -> Path:
    folder = root / name
    folder.mkdir(exist_ok=True)
    (folder / "__init__.py").write_text(INIT.format(fresh=fresh))
    (folder / "kern.py").write_text(KERNEL)
    (folder / "helper.py").write_text(
        f"import numba\n\n\n@numba.njit\ndef h(x):\n    return x + {add}\n"
    )
    return folder


def test_an_edited_helper_is_compiled_into_the_kernel(tmp_path: Path) -> None:
    for name, fresh in (("with_fresh", True), ("control", False)):
        _package(tmp_path, name, fresh, add=1)
        assert _answer(tmp_path, name) == "2"
        assert list((tmp_path / name / "__pycache__").glob("kern.k-*.nbc"))  # cached
        _package(tmp_path, name, fresh, add=2)  # the helper's file changes, the kernel's not
    assert _answer(tmp_path, "with_fresh") == "3"
    assert _answer(tmp_path, "control") == "2"  # numba's own cache: the stale helper
