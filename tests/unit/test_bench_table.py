"""Every kept result records the load average before and after its bench."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlstream.ops.bench import common


def test_save_records_the_load_before_and_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLSTREAM_RESULTS", str(tmp_path))
    loads = iter([(3.0, 2.0, 1.0), (4.0, 2.5, 1.5)])
    monkeypatch.setattr(common.os, "getloadavg", lambda: next(loads))
    monkeypatch.setattr(common, "_load_before", None)  # restored after the test
    common.mark_start()
    saved = json.loads(common.save("t", {"x": 1}).read_text())
    assert saved["load_average"] == {"before": [3.0, 2.0, 1.0], "after": [4.0, 2.5, 1.5]}
