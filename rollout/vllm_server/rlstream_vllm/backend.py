"""``RlstreamTransfer``: vLLM's weight-transfer engine for versions rlstream has verified.

vLLM drives it through its four-phase protocol (routes of ``VLLM_SERVER_DEV_MODE=1``):
``/init_weight_transfer_engine`` once, then per version ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``; the caller pauses generation around the three
(``/pause``, ``/resume``). The rlstream side has already fetched the version from Kafka, checked
its signature and every hash, and decoded it; it writes the tensors that changed (whole decoder
layers, checkpoint names) as one safetensors file into shared memory, which this engine loads:

- ``init_info``: ``{"report": PATH, "version": N}`` (N: the version the server started on).
  After every update the engine writes a JSON report to PATH (``outcome`` ``ready|ok|refused|
  broken``, the ``version`` and ``state_hash`` it holds, ``offered`` and ``reason`` of a version
  it did not take): HTTP answers carry no body from an engine.
- ``update_info``: ``{"path": FILE, "sha256": HEX, "version": N}`` (changed tensors) or
  ``{"folder": DIR, "version": N}`` (a whole checkpoint, reloaded from disk: the repair path and
  the baseline an in-place swap is measured against).
- Refused, with the model untouched: a file whose SHA-256 is not the sender's (torn or corrupt),
  that does not parse, or whose tensors do not fit the model (``weights.check``). A failure after
  the model was touched is ``broken``: the engine refuses every later update and its caller must
  restart it (its weights may be half old, half new).
- Loaded through the model's own weight loader: vLLM's in-place reload with the tensors in
  checkpoint format, which maps HF names onto vLLM's fused parameters (``qkv_proj``,
  ``w13_weight`` ...). On CPU the fused-MoE method skips re-packing its experts after a reload
  (they would stay in checkpoint layout and the model would match neither version), and a tied
  LM head keeps its own packed copy of the embedding: both are processed again here.
- ``state_hash`` in the report: rlstream's state hash (``weights.rows_hash``) of the checkpoint
  the engine holds, computed here from the bytes it loaded (the folder it started from, then each
  file it took): equal to the learner's state hash when the checkpoint's names and dtypes are the
  learner's.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rlstream_vllm.weights import (
    Row,
    check,
    checkpoint_table,
    file_rows,
    folder_rows,
    layer_of,
    rows_hash,
)
from safetensors.torch import load as load_safetensors
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.inplace import reload_weights


@dataclass
class RlstreamInitInfo(WeightTransferInitInfo):
    report: str
    """The file the engine writes its report to after every update."""
    version: int = -1
    """The version the checkpoint the server started from holds (-1: unknown)."""


@dataclass
class RlstreamUpdateInfo(WeightTransferUpdateInfo):
    version: int = -1
    path: str = ""
    """A safetensors file of the changed tensors, in checkpoint names."""
    sha256: str = ""
    """SHA-256 of that file as the sender wrote it."""
    folder: str = ""
    """Or a whole checkpoint to reload from disk."""


class VersionRefused(ValueError):
    """A version the engine did not take; the model is untouched."""


class EngineBroken(RuntimeError):
    """A failure after the model was touched: the engine must not serve again."""


class RlstreamTransfer(WeightTransferEngine[RlstreamInitInfo, RlstreamUpdateInfo]):
    """See the module docstring."""

    init_info_cls = RlstreamInitInfo
    update_info_cls = RlstreamUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start_folder = str(self.model_config.model)
        self.table = checkpoint_table(self.start_folder)  # of the model the server started from
        self.rows: dict[str, Row] | None = None
        self.version = -1
        self.report_path: Path | None = None
        self.broken = ""
        self._session: dict[str, Any] = {}

    # -- vLLM's protocol ---------------------------------------------------------------------

    def init_transfer_engine(self, init_info: RlstreamInitInfo) -> None:
        self.report_path = Path(init_info.report)
        if self.rows is None:
            self.rows = folder_rows(self.start_folder)
            self.version = init_info.version
        self._report({"outcome": "ready", "loaded": 0, "seconds": 0.0, "reason": ""})

    def start_weight_update(self) -> None:
        self._session = {}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one update (the base class would also synchronize an accelerator, which a CPU
        build does not have)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: RlstreamUpdateInfo) -> None:
        try:
            if self.broken:
                raise VersionRefused(f"the engine is broken since an earlier update: {self.broken}")
            started = time.perf_counter()
            if update_info.folder:
                rows, loaded = self._reload(update_info.folder)
            else:
                rows, loaded = self._load(update_info.path, update_info.sha256)
        except (VersionRefused, EngineBroken) as exc:
            outcome = "refused" if isinstance(exc, VersionRefused) else "broken"
            self._report({"outcome": outcome, "offered": update_info.version, "reason": str(exc)})
            raise
        self._session = {
            "version": update_info.version,
            "rows": rows,
            "whole": bool(update_info.folder),
            "loaded": loaded,
            "seconds": time.perf_counter() - started,
        }

    def finish_weight_update(self) -> None:
        session, self._session = self._session, {}
        if not session:
            return
        assert self.rows is not None
        self.rows = session["rows"] if session["whole"] else {**self.rows, **session["rows"]}
        self.version = session["version"]
        self._report({"outcome": "ok", "loaded": session["loaded"], "seconds": session["seconds"]})

    def shutdown(self) -> None:
        self._session = {}

    # -- loading -----------------------------------------------------------------------------

    def _load(self, path: str, sha256: str) -> tuple[dict[str, Row], int]:
        data = Path(path).read_bytes()
        if hashlib.sha256(data).hexdigest() != sha256:
            raise VersionRefused(f"{path}: SHA-256 differs from the sender's")
        try:
            tensors = load_safetensors(data)
            rows = file_rows(data)
        except Exception as exc:  # a file that does not parse is refused like any other
            raise VersionRefused(f"{path}: {exc}") from exc
        reason = check(tensors, self.table)
        if reason:
            raise VersionRefused(reason)
        try:
            reload_weights(
                self.vllm_config,
                self.model,
                weights_iterator=iter(sorted(tensors.items())),
                weights_path=None,
                is_checkpoint_format=True,
            )
            self._repack({layer_of(n) for n in tensors if ".experts." in n})
            if any("embed_tokens" in n for n in tensors):
                self._retie()
        except Exception as exc:  # the model may be half loaded: never serve from it again
            self.broken = f"{type(exc).__name__}: {exc}"
            raise EngineBroken(self.broken) from exc
        return rows, len(tensors)

    def _reload(self, folder: str) -> tuple[dict[str, Row], int]:
        if set(checkpoint_table(folder)) != set(self.table):
            raise VersionRefused(f"{folder} is not a checkpoint of this model (other tensor names)")
        rows = folder_rows(folder)
        model_config = self.vllm_config.model_config
        started_from = model_config.model
        try:
            reload_weights(
                self.vllm_config,
                self.model,
                weights_iterator=None,
                weights_path=folder,
                is_checkpoint_format=True,
            )
            self._repack({layer_of(n) for n in self.table if ".experts." in n})
            self._retie()
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise EngineBroken(self.broken) from exc
        finally:
            model_config.model = started_from  # the reload points it at a folder soon gone
        return rows, len(rows)

    def _repack(self, layers: set[str | None]) -> None:
        """Run the experts' post-load processing again where the platform skips it (CPU)."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        for name, module in self.model.named_modules():
            method = getattr(module, "quant_method", None)
            kernel = getattr(method, "moe_kernel", None)
            if kernel is None or not any(name.startswith(f"{layer}.") for layer in layers if layer):
                continue
            kernel.fused_experts.process_weights_after_loading(module)

    def _retie(self) -> None:
        """Process again every layer that shares the embedding's weight (a tied LM head): on CPU
        it keeps its own packed copy for the logits GEMM, which a reload of the embedding alone
        leaves stale."""
        embeddings = [m for n, m in self.model.named_modules() if n.endswith("embed_tokens")]
        if len(embeddings) != 1:
            raise RuntimeError(f"expected one embed_tokens module, found {len(embeddings)}")
        embedding = embeddings[0]
        for module in self.model.modules():
            weight = getattr(module, "weight", None)
            method = getattr(module, "quant_method", None)
            if module is embedding or method is None or not isinstance(weight, torch.Tensor):
                continue
            if weight.data_ptr() == embedding.weight.data_ptr():
                method.process_weights_after_loading(module)

    # -- the report --------------------------------------------------------------------------

    def _report(self, fields: dict[str, Any]) -> None:
        if self.report_path is None:
            return
        report = {
            "version": self.version,
            "state_hash": rows_hash(self.rows.values()) if self.rows is not None else "",
            "broken": self.broken,
            "pid": os.getpid(),
            "at": time.time(),
            **fields,
        }
        partial = self.report_path.with_name(self.report_path.name + ".part")
        partial.write_text(json.dumps(report))
        os.replace(partial, self.report_path)
