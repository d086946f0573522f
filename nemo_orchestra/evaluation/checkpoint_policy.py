"""A trained orchestrator as the evaluation policy: a Hugging Face export folder, run in process.

``checkpoint:DIR`` takes a run folder (its ``hf/`` export) or an export folder itself. It is the
``hf`` generation engine on the exported weights, driven by the same ``EnginePolicy`` as training's
rollouts: the prompt is the chat template's rendering of the episode's messages and tools, the
policy's own turns stay as it generated them. Generation is greedy by default.
"""

from __future__ import annotations

import os

import torch

from nemo_orchestra.prompting.chat import ChatFormat
from nemo_orchestra.rollout.engines.hf import HFEngine
from nemo_orchestra.rollout.loop import EnginePolicy


def resolve_export(path: str) -> str:
    for folder in (os.path.join(path, "hf"), path):
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    raise FileNotFoundError(f"checkpoint:{path}: no Hugging Face export (config.json) in {path} or {path}/hf")


def checkpoint_policy(path: str, temperature: float = 0.0, max_new_tokens: int = 96, top_p: float = 1.0,
                      seed: int = 0) -> EnginePolicy:
    from transformers import AutoTokenizer

    folder = resolve_export(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    torch.manual_seed(seed)  # sampling (temperature > 0) draws from torch's generator
    engine = HFEngine.from_export(folder, tokenizer)
    name = f"checkpoint:{os.path.basename(os.path.normpath(path))}"
    return EnginePolicy(engine, ChatFormat(tokenizer), max_new_tokens, temperature, top_p, name=name)
