"""rlstream's weight-transfer backend for vLLM (``backend.RlstreamTransfer``), registered under
the name ``rlstream`` by :func:`register`, which vLLM calls in every one of its processes through
the ``vllm.general_plugins`` entry point of this package. Nothing here imports rlstream: the
package runs in vLLM's virtualenv, and the rlstream side (``rollout.vllm_engine``) reaches it
through vLLM's own HTTP routes only."""

from __future__ import annotations

BACKEND = "rlstream"


def register() -> None:
    """Register the backend with vLLM's weight-transfer factory (idempotent: vLLM may load its
    plugins more than once in one process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "rlstream_vllm.backend", "RlstreamTransfer"
        )
