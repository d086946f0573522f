"""``model.init_from`` with a vocabulary of another size: two sizes mean two tokenizers, and a token
id names another token in each, so the message names the checkpoint's own tokenizer
(``model.tokenizer=<its run>/tokenizer``); ``model.vocab_size`` is suggested only when the tokenizer
is the same (then only the padding differs)."""

import json
import shutil
from types import SimpleNamespace

import pytest

from nemo_orchestra.config import load_config
from nemo_orchestra.megatron import dist_ckpt
from nemo_orchestra.megatron.model import check_vocab
from nemo_orchestra.train.learner import load_pretrained, same_tokenizer, source_tokenizer
from tests.helpers import TINY_MODEL

TINY = [*TINY_MODEL]


def _tokenizer(folder, tokens):
    folder.mkdir(parents=True, exist_ok=True)
    spec = {"model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(tokens)}}, "added_tokens": []}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def _checkpoint(run, model_cfg, vocab_size):
    """A run folder's checkpoint as model.init_from sees it before loading any weight."""
    folder = run / "checkpoints" / "step_00000005"
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text("{}")
    dist_ckpt.write_meta(str(folder), model_cfg, vocab_size, step=5)
    return folder


def test_another_tokenizer_names_the_checkpoints_tokenizer_not_its_size(tmp_path):
    cfg = load_config(TINY)
    old_run = tmp_path / "old"
    _tokenizer(old_run / "tokenizer", ["a", "b", "c", "expert-1"])
    folder = _checkpoint(old_run, cfg.model, 2176)
    mine = _tokenizer(tmp_path / "new" / "tokenizer", ["a", "b", "calculator"])  # another tool set
    with pytest.raises(ValueError) as e:
        load_pretrained(SimpleNamespace(vocab_size=1856), str(folder), cfg.model, str(mine))
    message = str(e.value)
    assert message == (
        f"model.init_from={folder}: the checkpoint's vocabulary has 2176 entries, the model 1856: the checkpoint "
        f"was trained with another tokenizer: set model.tokenizer={old_run / 'tokenizer'} so that token ids mean "
        "the same (a different model.vocab_size would load embeddings of other tokens)"
    )
    assert "set model.vocab_size" not in message


def test_the_same_tokenizer_padded_otherwise_suggests_the_size(tmp_path):
    cfg = load_config(TINY)
    old_run = tmp_path / "old"
    _tokenizer(old_run / "tokenizer", ["a", "b", "c"])
    folder = _checkpoint(old_run, cfg.model, 2176)
    mine = tmp_path / "new" / "tokenizer"
    shutil.copytree(old_run / "tokenizer", mine)  # a copy: the same token ids
    with pytest.raises(
        ValueError, match=r"the tokenizer is the same, padded to another size: set model.vocab_size=2176$"
    ):
        load_pretrained(SimpleNamespace(vocab_size=1856), str(folder), cfg.model, str(mine))


def test_where_the_tokenizer_of_a_source_is_found(tmp_path):
    hf = _tokenizer(tmp_path / "hf", ["x"])  # a Hugging Face folder, an export: its own files
    run = tmp_path / "run"
    _tokenizer(run / "tokenizer", ["y"])
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    assert source_tokenizer(str(hf)) == str(hf)
    assert source_tokenizer(str(run / "checkpoints" / "step_00000001")) == str(run / "tokenizer")
    assert source_tokenizer(str(tmp_path / "nothing")) is None
    assert same_tokenizer(str(hf), str(hf)) and not same_tokenizer(str(hf), str(run / "tokenizer"))
    assert not same_tokenizer(None, str(hf)) and not same_tokenizer(str(hf), str(tmp_path / "missing"))


def test_no_tokenizer_found_still_says_which_key():
    with pytest.raises(ValueError, match=r"set model.tokenizer=<the tokenizer it was trained with> so that token ids"):
        check_vocab(2176, 1856, "/somewhere")
    check_vocab(1856, 1856, "/somewhere")  # the same size: nothing to say
