"""Targets for ``ops.run.ranks.run_local_ranks`` in tests: importable by name, as spawned ranks
need."""

from __future__ import annotations

import time
from typing import Any


def rank_1_dies(rank: int, world: int, port: int, out: Any) -> None:
    """Rank 1 exits with 3 at once; rank 0 would wait for it (as in a collective) far longer
    than the test allows."""
    if rank == 1:
        raise SystemExit(3)
    time.sleep(300)
    out.put("never")
