"""Tokenizers: a real one from a local folder, or the embedded one built here without downloads.

The embedded tokenizer is a byte-level BPE trained on text of the embedded default task set
(problems, tool schemas, rendered trajectories), with Qwen3's special tokens and chat template,
saved as a Hugging Face ``PreTrainedTokenizerFast`` so the run folder and the export carry it.
Its merges are not cut at spaces and punctuation (digits stay single), so the tool schemas and
turn boilerplate the corpus repeats become a few long tokens: the default held-out prompts are
170-214 tokens (mean 197) instead of 536-666 (mean 613) with GPT-2-style pre-splitting. That is
about a third of the compute per step. Phrases handed in (``phrases``) are single tokens matched
before BPE: the run passes the default task set's plans (``default_tasks.plan_phrases``), so each
(kind of task, preference, action) has an output row of its own and GRPO can make the tool choice
depend on the preference without moving the same choice under the other preference.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

from nemo_orchestra.prompting.chat import QWEN3_CHAT_TEMPLATE, SPECIAL_TOKENS

log = logging.getLogger(__name__)


def build_embedded_tokenizer(
    corpus: Iterable[str], vocab_size: int = 2048, max_token_length: int = 24, phrases: Iterable[str] = ()
):
    """``phrases``: strings that are always one token each (matched before BPE), e.g. the plans
    of ``default_tasks.plan_phrases``."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # no split at spaces or punctuation (as SentencePiece without whitespace splitting), digits one
    # by one (as Qwen's and Llama's tokenizers): merges may span the JSON and prose the corpus
    # repeats, up to max_token_length characters. A minus sign before a digit is a token of its own, so
    # a negative number is the same tokens wherever it stands: a tool result's "-48" and an answer's
    # '"-48"' share "-", "4", "8" (merged into the text before it, the answer's sign would be part of
    # '"answer": "-' and the copy of a negative result a different task from a positive one's)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"-(?=\d)"), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        max_token_length=max_token_length,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(p, normalized=False) for p in phrases])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = QWEN3_CHAT_TEMPLATE
    log.info("built embedded tokenizer: %d tokens", len(fast))
    return fast


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model.tokenizer: no tokenizer folder at {path}")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.chat_template is None:
        raise ValueError(f"model.tokenizer: the tokenizer at {path} has no chat template")
    missing = [t for t in ("<|im_end|>", "<tool_call>", "</tool_call>") if t not in tok.get_vocab()]
    if missing:
        raise ValueError(f"model.tokenizer: the tokenizer at {path} lacks Qwen3 tokens {missing}")
    return tok
