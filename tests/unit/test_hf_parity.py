"""Our Megatron Qwen3 equals transformers' Qwen3 on the same weights; export round-trips."""

import pytest
import torch

from nemo_orchestra.config import load_config
from nemo_orchestra.export.qwen3 import full_state_dict, hf_to_megatron, megatron_to_hf
from nemo_orchestra.megatron.forward import forward_logprobs
from nemo_orchestra.megatron.model import build_gpt_model
from nemo_orchestra.megatron.parallel import init_distributed
from nemo_orchestra.train.packing import pack
from tests.helpers import traj

VOCAB = 256


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def models(request):
    from transformers import Qwen3ForCausalLM

    from nemo_orchestra.export.qwen3 import hf_config

    cfg = load_config([f"model.tie_embeddings={request.param}", "model.num_layers=2"])
    info = init_distributed(cfg.parallel, seed=7)
    torch.manual_seed(request.param)
    gpt = build_gpt_model(cfg.model, cfg.parallel, VOCAB, info.device).eval()
    with torch.no_grad():  # norms start at 1: perturb them so their mapping is exercised
        for name, p in gpt.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf = Qwen3ForCausalLM(hf_config(cfg.model, VOCAB)).eval()
    missing, unexpected = hf.load_state_dict(megatron_to_hf(full_state_dict(gpt), cfg.model), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if cfg.model.tie_embeddings:
        hf.tie_weights()
    return cfg, gpt, hf


def test_logits_equal_transformers(models):
    cfg, gpt, hf = models
    a = traj(ids=torch.randint(0, VOCAB, (37,)).tolist(), mask=[1] * 37)
    b = traj(ids=torch.randint(0, VOCAB, (11,)).tolist(), mask=[1] * 11)
    (batch,) = pack([a, b], capacity=64)
    ours = forward_logprobs(gpt, batch, torch.device("cpu"))
    with torch.no_grad():
        for t, (s, e) in zip(
            [a, b] if batch.traj_index_B[0] == 0 else [b, a],
            zip(batch.cu_seqlens_B1[:-1].tolist(), batch.cu_seqlens_B1[1:].tolist()),
        ):
            logits = hf(torch.tensor([t.token_ids])).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(t.token_ids[1:])[:, None])[:, 0]
            torch.testing.assert_close(ours[s : e - 1], lp, atol=2e-5, rtol=1e-5)


def test_import_of_export_is_identity(models):
    cfg, gpt, _ = models
    sd = full_state_dict(gpt)
    back = hf_to_megatron(megatron_to_hf(sd, cfg.model), cfg.model)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_export_folder_loads_offline(models, tmp_path):
    from transformers import AutoModelForCausalLM

    from nemo_orchestra.export.hf_folder import export_hf

    cfg, gpt, hf = models
    export_hf(full_state_dict(gpt), cfg.model, VOCAB, None, str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).eval()
    ids = torch.randint(0, VOCAB, (1, 19))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, hf(ids).logits)


@pytest.mark.parametrize("sampling", [(0.7, 0.9), (0.0, 1.0)], ids=["sampled", "greedy"])
def test_export_generation_config_samples_as_the_run_did(models, tmp_path, sampling):
    """A server that reads generation_config.json (vLLM's does) samples by default as training did."""
    from transformers import GenerationConfig

    from nemo_orchestra.export.hf_folder import export_hf

    cfg, gpt, _ = models
    export_hf(full_state_dict(gpt), cfg.model, VOCAB, None, str(tmp_path), sampling=sampling)
    gen = GenerationConfig.from_pretrained(str(tmp_path), local_files_only=True)
    if sampling[0] > 0:
        assert gen.do_sample and (gen.temperature, gen.top_p) == sampling
    else:
        assert not gen.do_sample


def test_a_checkpoint_export_takes_its_runs_sampling(tmp_path):
    from nemo_orchestra.export.convert import run_sampling

    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"
    ckpt.mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("rollout:\n  temperature: 0.7\n  top_p: 0.9\n")
    assert run_sampling(str(ckpt)) == (0.7, 0.9)
    assert run_sampling(str(tmp_path / "imported")) == (1.0, 1.0)  # not in a run folder: the full distribution
