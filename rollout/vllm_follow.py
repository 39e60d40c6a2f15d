"""``rlstream serve vllm``: a vLLM server someone else runs follows a run's verified versions.

The server is a stock one: vLLM's OpenAI server with rlstream's weight-transfer backend
installed in its virtualenv (``pip install --no-deps rollout/vllm_server``) and named on its
command line (``--weight-transfer-config '{"backend": "rlstream"}'``, with
``VLLM_SERVER_DEV_MODE=1`` for the weight-transfer routes). This process, on the same host (the
versions travel through shared memory), subscribes to the run's weight stream, checks every
version's signature and hashes (``WeightSubscriber``), and hands each verified version to the
server through ``rollout.vllm_engine.VllmEngine`` pointed at its URL: the changed tensors are
found and written before generation pauses, the pause covers only the load, and the engine is
checked after every swap (the backend's checkpoint hash, the canary) and repaired by a whole
reload when it fails.

What happens to requests in flight: ``/pause?mode=wait`` lets them finish on the version they
started on (their tokens all come from one version; new requests queue meanwhile), the prefix
cache is dropped, and every request after ``/resume`` runs on the new version. The pause a
user feels is therefore the load plus the longest request in flight.

The first version taken is loaded whole (what a server started from some checkpoint holds is
not known); each later one as changed tensors. A version the server refuses is skipped and the
next one tried; the process gives up (exit status 1) when the server cannot be repaired.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlstream.consumers.weights.subscriber import WeightSubscriber
from rlstream.producers.client.settings import KafkaSettings
from rlstream.rollout.config import PolicyConfig, VllmConfig
from rlstream.rollout.engines import EngineRefused, percentile
from rlstream.rollout.model import build_policy
from rlstream.rollout.vllm_engine import VllmEngine
from rlstream.schemas.deltacodec import state_hash, to_torch
from rlstream.schemas.derive import derive


def served_model(url: str, timeout: float = 10.0) -> str:
    """The name the server at ``url`` serves its model under (its first ``/v1/models`` entry)."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=timeout) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


class VllmFollower:
    """Keeps the vLLM server at ``url`` on run ``run``'s newest verified version of ``model``."""

    def __init__(
        self,
        settings: KafkaSettings,
        run: str,
        model: str,
        policy: PolicyConfig,
        vllm: VllmConfig,
        url: str,
        *,
        source: str | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.run, self.log = run, log
        self.subscriber = WeightSubscriber(settings, run, model, source=source)
        cfg = derive(vllm, url=url.rstrip("/"))
        work = Path(cfg.work_dir or tempfile.gettempdir())
        self.engine = VllmEngine(
            cfg, build_policy(policy).eval(), policy, served_model(url), work / "vllm-follow.log"
        )
        self.refused: dict[int, str] = {}

    @property
    def version(self) -> int:
        return self.engine.version

    def step(self, timeout: float = 1.0) -> dict[str, Any] | None:
        """Wait up to ``timeout`` for a newer verified version and hand it to the server; what
        happened (None when nothing newer came)."""
        self.subscriber.poll(timeout)
        current = self.subscriber.current()
        if current is None or current[0] <= self.version or current[0] in self.refused:
            return None
        version, state = current
        signed = state_hash(state)
        stats = self.engine.stats
        before = (stats.swaps, stats.check_failures, stats.repairs)
        started = time.perf_counter()
        try:
            self.engine.push(version, to_torch(state), signed)
        except EngineRefused as exc:
            self.refused[version] = str(exc)
            self.log(f"vllm: version {version} refused: {exc}")
            return {"version": version, "refused": str(exc)}
        swapped = stats.swaps > before[0]
        line = {
            "version": version,
            "learner_state_hash": signed,
            "engine_state_hash": self.engine.report().get("state_hash"),
            "whole": not swapped,
            "pause_s": stats.swap_s[-1] if swapped else None,
            "sync_s": stats.sync_s[-1] if swapped else time.perf_counter() - started,
            "check_failures": stats.check_failures - before[1],
            "repaired": stats.repairs - before[2],
        }
        how = f"pause {line['pause_s']:.3f} s" if swapped else "loaded whole"
        self.log(f"vllm: serving version {version} ({how}, sync {line['sync_s']:.3f} s)")
        return line

    def summary(self) -> dict[str, Any]:
        """The figures of every swap so far (as the demo's JSON names them)."""
        stats = self.engine.stats
        return {
            "version": self.version,
            "swaps": stats.swaps,
            "refused": len(self.refused),
            "pause_s_p50": percentile(stats.swap_s, 50),
            "pause_s_p99": percentile(stats.swap_s, 99),
            "sync_s_p50": percentile(stats.sync_s, 50),
            "engine_checks": {
                "checked": stats.checks + stats.hash_checks,
                "mismatches": stats.check_failures,
                "repaired": stats.repairs,
            },
        }

    def close(self) -> None:
        self.engine.close()
        self.subscriber.close()
