"""A trained orchestrator as the evaluation policy: a Hugging Face export folder, run in-process.

``checkpoint:DIR`` takes a run folder (its ``hf/`` export) or an export folder itself. The prompt
is built exactly as in training (the same system prompt, the problem followed by the preference,
the same chat template and tool schemas); the policy's own earlier turns are replayed as it wrote them.
Generation is greedy by default. The policy's tokens are priced like the orchestrator in training.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from nemo_orchestra.data.default_tasks import orchestrator_messages
from nemo_orchestra.evaluation.policy import (
    Policy,
    PolicyFormatError,
    PolicyInput,
    ToolCall,
)
from nemo_orchestra.prompting.chat import (
    ChatFormat,
    ToolCallParseError,
    parse_tool_call,
)


def resolve_export(path: str) -> str:
    for folder in (os.path.join(path, "hf"), path):
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    raise FileNotFoundError(f"checkpoint:{path}: no Hugging Face export (config.json) in {path} or {path}/hf")


def training_messages(inp: PolicyInput) -> list[dict[str, Any]]:
    """The conversation as a training rollout has it: ``orchestrator_messages`` for the problem and
    preference, then the turns so far, the policy's own as it wrote them."""
    out = orchestrator_messages(inp.problem, inp.preference, inp.preference_name)
    for m in inp.messages[1:]:  # the first is the problem, which orchestrator_messages states
        if m["role"] == "assistant" and m.get("content"):
            out.append({"role": "assistant", "content": m["content"]})
        else:
            out.append(m)
    return out


class CheckpointPolicy(Policy):
    def __init__(self, path: str, temperature: float = 0.0, max_new_tokens: int = 96,
                 price_in: float = 0.2, price_out: float = 0.2, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = resolve_export(path)
        self.name = f"checkpoint:{os.path.basename(os.path.normpath(path))}"
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
        self.chat = ChatFormat(tokenizer)
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.price_in, self.price_out = price_in, price_out
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def _generate(self, ids: list[int]) -> list[int]:
        stop = self.chat.end_of_turn_id
        kwargs = dict(do_sample=False) if self.temperature == 0 else dict(do_sample=True, temperature=self.temperature, top_k=0)
        out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=self.max_new_tokens, eos_token_id=stop,
                                  pad_token_id=self.chat.tokenizer.pad_token_id, **kwargs)
        new = out[0, len(ids):].tolist()
        return new[: new.index(stop)] if stop in new else new

    async def act(self, inp: PolicyInput) -> ToolCall:
        ids = self.chat.prompt_ids(training_messages(inp), inp.tools)
        new = self._generate(ids)
        text = self.chat.decode(new)
        cost = (len(ids) * self.price_in + len(new) * self.price_out) / 1e6
        try:
            call = parse_tool_call(text)
        except ToolCallParseError as e:
            err = PolicyFormatError(str(e))
            err.text, err.cost = text, cost
            raise err from None
        return ToolCall(call.name, call.arguments, text=text, cost=cost)
