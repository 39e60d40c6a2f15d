"""A harness's vLLM weight-transfer backend: rlstream's own, whose loads after the server's
first fail half-way (the new tensors are in the model, the experts not yet re-packed), so the
engine is really half swapped. Registered as ``rlstream-half-failing`` when vLLM imports this
module's worker extension (``rollout.vllm.extension``, set by the test with the backend name)."""

from rlstream_vllm.backend import RlstreamTransfer
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "rlstream-half-failing"


class HalfFailingTransfer(RlstreamTransfer):
    def _repack(self, layers):  # type: ignore[no-untyped-def]
        self._harness_loads = getattr(self, "_harness_loads", 0) + 1
        if self._harness_loads > 1:
            raise RuntimeError(f"fault injected by the harness at load {self._harness_loads}")
        super()._repack(layers)


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, HalfFailingTransfer)


class Register:
    """The worker extension vLLM imports (it adds nothing to the worker: the import registers)."""
