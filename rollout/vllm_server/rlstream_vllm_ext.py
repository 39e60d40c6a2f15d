"""rlstream's vLLM worker extension: weight versions loaded in place, without a restart.

Loaded by vLLM's worker process (``--worker-extension-cls rlstream_vllm_ext.WeightSwap``, this
folder on its ``PYTHONPATH``) inside vLLM's own virtualenv: it imports vLLM, torch and
safetensors, never rlstream. It is called through the server's ``POST /collective_rpc`` with
string arguments only (the endpoint's rule).

``rlstream_load(path, sha256)`` loads the tensors of one safetensors file (written by the rollout
worker into /dev/shm, holding only the tensors that changed, under their checkpoint names) into
the running model. Rules and guarantees:

- Refused, with the model untouched, when: the file's SHA-256 is not ``sha256`` (a torn or
  corrupt transfer); a tensor is not one of the model's checkpoint tensors (names, shapes and
  dtypes of the safetensors files the server started from); a value is not finite; a decoder
  layer is sent only in part (vLLM reloads a fused layer, e.g. ``qkv_proj`` or the experts, as a
  whole: a layer given in part would keep garbage in the parts it was not given).
- Loaded through the model's own weight loader: vLLM's in-place reload
  (``model_runner.reload_weights`` with the tensors, in checkpoint format), which maps the HF
  names onto vLLM's fused parameters (``qkv_proj``, ``w13_weight`` ...). On CPU the fused-MoE
  method skips re-packing its experts after a reload (they would stay in checkpoint layout and
  the model would match neither version), so every MoE layer that was given its experts has its
  experts' post-load processing (padding, pre-packing) run again here.
- A failure after the model was touched is answered ``broken``: the engine must not serve
  again (its weights may be half old, half new); the rollout worker restarts it.
- ``rlstream_reload(folder)``: the baseline a swap is measured against, vLLM's reload of a
  whole checkpoint from disk (``reload_weights(weights_path=folder)``), made right for MoE on CPU
  the same way.
- Answers a JSON object: ``{"ok": true, "loaded": N, "seconds": S}`` or ``{"ok": false,
  "refused" | "broken": reason}``.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def layer_of(name: str) -> str | None:
    """The decoder layer a checkpoint tensor belongs to (``model.layers.3``), or None."""
    match = LAYER.match(name)
    return match.group(1) if match else None


def checkpoint_table(folder: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of every tensor in the safetensors files of ``folder``."""
    table: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        header_len = int.from_bytes(path.open("rb").read(8), "little")
        with path.open("rb") as f:
            f.seek(8)
            header = json.loads(f.read(header_len))
        for name, entry in header.items():
            if name != "__metadata__":
                table[name] = (tuple(entry["shape"]), str(entry["dtype"]))
    return table


def check(tensors: dict[str, torch.Tensor], table: dict[str, tuple[tuple[int, ...], str]]) -> str:
    """Why ``tensors`` cannot be loaded into a model of checkpoint ``table`` ('' if they can)."""
    for name, tensor in tensors.items():
        if name not in table:
            return f"{name} is not a tensor of this model"
        shape, _ = table[name]
        if tuple(tensor.shape) != shape:
            return f"{name} has shape {tuple(tensor.shape)}, the model's is {shape}"
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"{name} holds values that are not finite"
    for layer in {layer_of(n) for n in tensors} - {None}:
        wanted = {n for n in table if layer_of(n) == layer}
        missing = wanted - set(tensors)
        if missing:
            return f"{layer} is given in part ({len(missing)} of {len(wanted)} tensors missing)"
    return ""


class WeightSwap:
    """Mixed into vLLM's worker (see the module docstring)."""

    def rlstream_load(self, path: str, sha256: str) -> dict[str, Any]:
        data = Path(path).read_bytes()
        if hashlib.sha256(data).hexdigest() != sha256:
            return {"ok": False, "refused": f"{path}: SHA-256 differs from the sender's"}
        try:
            tensors = load_safetensors(data)
        except Exception as exc:  # a file that does not parse is refused like any other
            return {"ok": False, "refused": f"{path}: {exc}"}
        reason = check(tensors, self._rlstream_table())
        if reason:
            return {"ok": False, "refused": reason}
        started = time.perf_counter()
        try:
            self.model_runner.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=iter(sorted(tensors.items())), is_checkpoint_format=True
            )
            self._rlstream_repack({layer_of(n) for n in tensors if ".experts." in n})
            if any("embed_tokens" in n for n in tensors):
                self._rlstream_retie()
        except Exception as exc:  # the model may be half loaded: never serve from it again
            return {"ok": False, "broken": f"{type(exc).__name__}: {exc}"}
        return {"ok": True, "loaded": len(tensors), "seconds": time.perf_counter() - started}

    def rlstream_reload(self, folder: str) -> dict[str, Any]:
        started = time.perf_counter()
        table = self._rlstream_table()  # of the model the server started with
        try:
            self.model_runner.reload_weights(weights_path=folder, is_checkpoint_format=True)  # type: ignore[attr-defined]
            self._rlstream_repack({layer_of(n) for n in table if ".experts." in n})
            self._rlstream_retie()
        except Exception as exc:
            return {"ok": False, "broken": f"{type(exc).__name__}: {exc}"}
        return {"ok": True, "seconds": time.perf_counter() - started}

    def _rlstream_table(self) -> dict[str, tuple[tuple[int, ...], str]]:
        table = getattr(self, "_rlstream_checkpoint", None)
        if table is None:
            folder = self.vllm_config.model_config.model  # type: ignore[attr-defined]
            table = checkpoint_table(folder)
            self._rlstream_checkpoint = table
        return table

    def _rlstream_repack(self, layers: set[str | None]) -> None:
        """Run the experts' post-load processing again where the platform skips it (CPU)."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        model = self.model_runner.model  # type: ignore[attr-defined]
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            kernel = getattr(method, "moe_kernel", None)
            if kernel is None or not any(name.startswith(f"{layer}.") for layer in layers if layer):
                continue
            kernel.fused_experts.process_weights_after_loading(module)

    def _rlstream_retie(self) -> None:
        """Process again every layer that shares the embedding's weight (a tied LM head): on CPU
        it keeps its own packed copy for the logits GEMM, which a reload of the embedding alone
        leaves stale."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        embeddings = [m for n, m in model.named_modules() if n.endswith("embed_tokens")]
        if len(embeddings) != 1:
            raise RuntimeError(f"expected one embed_tokens module, found {len(embeddings)}")
        embedding = embeddings[0]
        for module in model.modules():
            weight = getattr(module, "weight", None)
            method = getattr(module, "quant_method", None)
            if module is embedding or method is None or not isinstance(weight, torch.Tensor):
                continue
            if weight.data_ptr() == embedding.weight.data_ptr():
                method.process_weights_after_loading(module)
