"""`recipes/benchmark.py generate`: the in-process engines on the same prompts, every sequence's
tokens counted, the prefill inside the call, the tokens compared with the first engine's, and a bound
whose counts are the exported model's."""

import json
import os
import subprocess
import sys

import pytest

from tools_env.supervisor import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "recipes", "benchmark.py")


def test_both_engines_measured_on_the_same_workload(tmp_path):
    out = tmp_path / "generate.json"
    args = ["--prompts", "6", "--prompt-tokens", "12", "--new-tokens", "5", "--calls", "1", "--out", str(out)]
    args += ["--engines", "megatron,hf,megatron:eager", "--profile", "megatron"]
    p = subprocess.run([sys.executable, SCRIPT, "generate", *args], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["engines"]) == ["megatron", "hf", "megatron:eager"]
    fastest = report["fastest"]
    assert report["engines"][fastest]["generated_tokens_per_s"] == max(
        r["generated_tokens_per_s"] for r in report["engines"].values()
    )
    # the overrides that run it; the megatron engine reads the policy's weights: ahead of training it runs on a
    # copy of its own
    name, graphs = fastest.removesuffix(":eager"), "false" if fastest.endswith(":eager") else "true"
    assert report["fastest_args"] == [f"rollout.engine={name}", f"rollout.cuda_graphs={graphs}"]
    ahead = {"hf": "hf", "megatron": "megatron_copy"}[name]
    assert report["fastest_ahead_args"] == [f"rollout.engine={ahead}", f"rollout.cuda_graphs={graphs}"]
    # the same seeds and weights: on a CPU (no graphs) the megatron engine's runs agree, and the hf engine computes
    # the same logits to the rounding
    assert report["engines"]["megatron"]["same_tokens"] == 1.0
    assert report["engines"]["megatron:eager"]["same_tokens"] == 1.0
    assert report["engines"]["hf"]["same_tokens"] >= 0.5
    bound = report["bound"]
    assert bound["decode_steps"] == 4 and bound["generate_s"] == pytest.approx(bound["prefill_s"] + bound["decode_s"])
    for name, r in report["engines"].items():
        assert r["generated_tokens"] == 6 * 5, name  # no stop token: every sequence runs to the end
        assert 0 < r["prefill_s"] < r["generate_s"]
        assert r["generated_tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["generate_s"])
        assert r["share_of_bound"] == pytest.approx(bound["generate_s"] / r["generate_s"])
        assert f"\n{name} " in p.stdout
        assert r["graphs_captured"] == r["graphs_captured_measured"] == 0, name  # no CUDA graphs on a CPU
        assert ("profile" in r) == (name == "megatron")
    # the profiled call: its ops' own CPU time (a CPU's) within the call's, the matrix multiplies among the most
    prof = report["engines"]["megatron"]["profile"]
    assert 0 < prof["device_s"] <= prof["wall_s"] and prof["busy_share"] == pytest.approx(
        prof["device_s"] / prof["wall_s"]
    )
    assert any(op["name"] in ("aten::mm", "aten::addmm", "aten::bmm") for op in prof["top"])
    assert sorted((op["self_ms"] for op in prof["top"]), reverse=True) == [op["self_ms"] for op in prof["top"]]
    assert "megatron under the profiler" in p.stdout
    assert 6 * 6 <= report["config"]["prompt_tokens"] <= 6 * 18  # lengths within half the mean either way


def test_the_bound_counts_what_the_exported_model_holds():
    """The layers' parameters and the KV width the bound uses, against the Hugging Face model the
    export makes of the same weights (another count of the same things)."""
    from benchmarks.generate import workload
    from nemo_orchestra.config import load_config
    from nemo_orchestra.export.qwen3 import hf_config
    from nemo_orchestra.megatron.model import build_gpt_model
    from nemo_orchestra.megatron.parallel import init_distributed
    from transformers import Qwen3ForCausalLM

    cfg = load_config([])
    info = init_distributed(cfg.parallel, 0)
    gpt = build_gpt_model(cfg.model, cfg.parallel, 512, info.device)
    hf = Qwen3ForCausalLM(hf_config(cfg.model, 512))
    layers = sum(p.numel() for n, p in hf.named_parameters() if n.startswith("model.layers."))
    layers += hf.model.norm.weight.numel()  # Megatron's decoder holds the final norm
    output = hf.lm_head.weight.numel()
    kv_width = hf.config.num_key_value_heads * hf.config.head_dim
    lengths, new = [3, 10], 4
    got = workload(gpt, lengths, new, bytes_per_param=4)
    attention = 2 * 2 * hf.config.num_hidden_layers * hf.config.num_attention_heads * hf.config.head_dim
    assert got["prefill_flops"] == 2 * layers * 13 + attention * (9 / 2 + 100 / 2) + 2 * output * 2
    kv = 2 * hf.config.num_hidden_layers * kv_width * 4 * sum(n + j for n in lengths for j in range(1, new))
    assert got["decode_bytes"] == (layers + output) * 4 * (new - 1) + kv


# the benchmark with an engine that cannot start without CUDA graphs (a stand-in for a capture that fails), and a
# profiler that fails
FAILING_ENGINE = """
import sys
import nemo_orchestra.rollout.engines as engines
from benchmarks import generate
start = engines.start_engine
def failing(name, ctx, state=None):
    if not ctx.rollout.cuda_graphs:
        raise RuntimeError("operation not permitted when stream is capturing\\nmore")
    return start(name, ctx, state)
engines.start_engine = failing
def failing_profile(*args, **kwargs):
    raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")
generate.profile_call = failing_profile
sys.exit(generate.main(generate_args(sys.argv[1:])))
"""


def test_an_engine_that_fails_leaves_the_others_measured(tmp_path):
    """A failing engine is named with its error; the others are measured and the fastest is among them;
    the exit status says something failed. A profiled call that fails loses the profile only."""
    out = tmp_path / "generate.json"
    args = ["--engines", "megatron:eager,megatron", "--prompts", "3", "--prompt-tokens", "8", "--new-tokens", "3"]
    args += ["--profile", "megatron"]
    driver = "import argparse\nfrom benchmarks.generate import add_args\n"
    driver += "def generate_args(a):\n    p = argparse.ArgumentParser()\n    add_args(p)\n    return p.parse_args(a)\n"
    p = subprocess.run(
        [sys.executable, "-c", driver + FAILING_ENGINE, *args, "--calls", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-3000:]
    report = json.loads(out.read_text())
    error = "RuntimeError: operation not permitted when stream is capturing\nmore"
    assert report["engines"]["megatron:eager"] == {"error": error}
    assert report["fastest"] == "megatron" and report["engines"]["megatron"]["same_tokens"] == 1.0
    assert report["engines"]["megatron"]["profile"] == {"error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}
    assert "megatron: the profiled call failed: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED" in p.stdout
    assert "megatron:eager: failed: RuntimeError: operation not permitted when stream is capturing\n" in p.stdout
    assert "error: megatron:eager failed (above); the others were measured" in p.stderr


def test_unknown_engine_or_profiled_engine_is_refused():
    p = subprocess.run(
        [sys.executable, SCRIPT, "generate", "--engines", "hf,vllm"], capture_output=True, text=True, timeout=120
    )
    assert (
        p.returncode == 2
        and "--engines takes hf, megatron, megatron_copy, each may end in :eager (got 'hf,vllm')" in p.stderr
    )
    p = subprocess.run(
        [sys.executable, SCRIPT, "generate", "--engines", "megatron", "--profile", "hf"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "--profile takes engines of --engines (megatron), got 'hf'" in p.stderr
