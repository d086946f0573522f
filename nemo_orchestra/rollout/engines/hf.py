"""In-process generation engine: a KV-cached Hugging Face Qwen3 fed the trainer's weights.

Token ids in, token ids and their logprobs out. After every optimizer step the trainer pushes
its weights in place (``load_weights``) under Hugging Face names; the same mapping is what the
export writes, so generator and export cannot drift apart.
"""

from __future__ import annotations

import threading

import torch

from nemo_orchestra.config import ModelConfig
from nemo_orchestra.export.qwen3 import hf_config, megatron_to_hf
from nemo_orchestra.rollout.engine_registry import ENGINES
from nemo_orchestra.rollout.engines.base import (
    EngineContext,
    Generation,
    GenerationEngine,
    check_seeds,
)
from nemo_orchestra.rollout.engines.sampling import row_generators, sample_rows
from nemo_orchestra.rollout.engines.streams import EngineStream


class HFEngine(GenerationEngine):
    capabilities = ENGINES["hf"].capabilities  # registered in rollout/engine_registry.py

    def __init__(
        self,
        model_cfg: ModelConfig | None,
        vocab_size: int,
        tokenizer,
        device: torch.device,
        model: torch.nn.Module | None = None,
    ):
        from transformers import Qwen3ForCausalLM

        self.model_cfg = model_cfg
        self.pad_id = tokenizer.pad_token_id
        if model is None:  # built where it runs: a large random init on the host CPU is slow
            with torch.device(device):
                model = Qwen3ForCausalLM(hf_config(model_cfg, vocab_size, tokenizer))
        self.model = model.to(device).eval()
        self.device = device
        self.stream = EngineStream(device)  # its weights are its own: its generate calls overlap training
        self.closed = threading.Event()  # set by close(): a generate call in flight stops at its next token

    @classmethod
    def create(cls, ctx: EngineContext, init_state: dict[str, torch.Tensor] | None) -> "HFEngine":
        engine = cls(ctx.model_cfg, ctx.vocab_size, ctx.tokenizer, ctx.device)
        if init_state is not None:
            engine.load_weights(init_state)
        return engine

    @classmethod
    def from_export(cls, folder: str, tokenizer, device: torch.device = torch.device("cpu")) -> "HFEngine":
        """The engine on an exported Hugging Face folder (``hf/`` of a run): what evaluation runs."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        return cls(None, 0, tokenizer, device, model=model)

    @torch.no_grad()
    def load_weights(self, megatron_state: dict[str, torch.Tensor]) -> None:
        if self.model_cfg is None:
            raise ValueError("hf engine: built from an export folder, it takes no trainer weights")
        with self.stream.run(after_trainer=True):
            hf = megatron_to_hf(megatron_state, self.model_cfg)
            missing, unexpected = self.model.load_state_dict(hf, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and self.model_cfg.tie_embeddings)]
        assert not missing and not unexpected, f"weight sync mismatch: {missing[:3]} {unexpected[:3]}"

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_ids: list[int],
        seeds: list[int] | None = None,
    ) -> list[Generation]:
        if self.closed.is_set():
            raise RuntimeError("hf engine: generate called after close()")
        if not prompts:
            return []
        check_seeds(seeds, len(prompts), "hf")
        with self.stream.run(after_trainer=False):
            return self._generate(prompts, max_new_tokens, temperature, top_p, stop_ids, seeds)

    def _generate(self, prompts, max_new_tokens, temperature, top_p, stop_ids, seeds) -> list[Generation]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        greedy = temperature <= 0  # greedy decoding; logprobs then under temperature 1
        if greedy:
            sampling = {"do_sample": False}
        elif seeds is None:
            sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
        else:  # each row draws from its own generator: the warped scores' race, then the argmax picks it
            sampling = {"do_sample": False, "logits_processor": seeded_draws(temperature, top_p, seeds, self.device)}
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
            stopping_criteria=until_closed(self.closed),
            **sampling,
        )
        new_BN = out.sequences[:, width:]
        scale = 1.0 if greedy else temperature
        # one position at a time, on the device: the full-vocab logits of every position never stack up
        lp_BN = torch.stack(
            [
                torch.log_softmax(logits_BV.float() / scale, dim=-1).gather(-1, new_BN[:, j, None])[:, 0]
                for j, logits_BV in enumerate(out.logits)
            ],
            dim=1,
        ).cpu()
        new_BN = new_BN.cpu()
        stops = set(stop_ids)
        results = []
        for row, lps in zip(new_BN.tolist(), lp_BN.tolist()):
            n = next((j + 1 for j, t in enumerate(row) if t in stops), None)
            results.append(Generation(row[: n or len(row)], lps[: n or len(row)], n is not None))
        return results

    def close(self) -> None:
        self.closed.set()


def seeded_draws(temperature: float, top_p: float, seeds: list[int], device: torch.device):
    """Logits processors that sample each row from its own seed (``engines/sampling.py``): Hugging
    Face's temperature and top-p warpers, as ``do_sample`` would apply them, then the row's draw left
    as the only finite score, for greedy decoding to take. Each row draws once per step, finished
    rows too, so a row's j-th token takes its generator's j-th draw whatever the batch."""
    from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    generators = row_generators(seeds, device)

    class Draw(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores_BV: torch.Tensor) -> torch.Tensor:
            ids_B = sample_rows(scores_BV.softmax(dim=-1, dtype=torch.float32), generators)
            # in place, no B x V copy: the warpers before it made these scores, not the raw logits kept for logprobs
            return scores_BV.fill_(float("-inf")).scatter_(-1, ids_B[:, None], 0.0)

    warpers = [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])
    return LogitsProcessorList([*warpers, Draw()])


def until_closed(closed: threading.Event):
    """Stopping criteria that end every sequence of a generate call once ``closed`` is set (the engine
    closed while rollouts are in flight: the process must not exit while the call runs)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class UntilClosed(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
            return torch.full((input_ids.shape[0],), closed.is_set(), dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([UntilClosed()])
