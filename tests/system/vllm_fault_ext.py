"""A harness's vLLM worker extension: rlstream's own, whose loads after the server's first fail
half-way (the new tensors are in the model, the experts not yet re-packed), so the engine is
really half swapped. Put on the server by the test's config (``rollout.vllm.extension``)."""

from rlstream_vllm_ext import WeightSwap


class HalfFailingSwap(WeightSwap):
    def _rlstream_repack(self, layers):  # type: ignore[no-untyped-def]
        self._harness_loads = getattr(self, "_harness_loads", 0) + 1
        if self._harness_loads > 1:
            raise RuntimeError(f"fault injected by the harness at load {self._harness_loads}")
        super()._rlstream_repack(layers)
