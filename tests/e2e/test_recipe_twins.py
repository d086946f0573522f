"""Each 8B recipe end to end on a CPU as its scaled-down twin: the recipe itself, with the tiny model swapped in
and FP8 off, TP=2 on two gloo ranks, two GRPO steps, on task files that recipes/synthesize_data.py writes. A
recipe that breaks (a key it sets that the code no longer takes, a combination the trainer refuses, a stage that
fails at its shape) shows here before an H100 sees it. The untrained tiny model writes no valid call, so the
recipe's filters drop every group: the update stage runs on no rollouts here (TP=2 updates are tested in
tests/integration/distributed/)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the twin changes of the recipe, each for a reason of the CPU's; everything else is the recipe's own.
TWIN = [
    "model=tiny",  # the tiny Qwen3-architecture model in place of Qwen3-8B
    "model.init_from=null",  # nothing to import: a fresh tiny model
    "model.params_dtype=fp32",
    "model.fp8=null",  # FP8 and TransformerEngine's attention need a GPU
    "model.attention_backend=auto",
    "trainer.max_steps=2",
    "model.max_position_embeddings=16384",  # room for the recipe's rollout.max_context
    "rollout.max_turns=2",  # an untrained model's turns run to their limit: short limits keep a step in seconds
    "rollout.max_new_tokens_per_turn=24",
    "rollout.engine=hf",  # one vLLM engine per rank would hold both cores; the vllm engine has its own e2e tests
    "run.stall_timeout_s=null",
]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toolscale")
    r = subprocess.run(
        [sys.executable, str(ROOT / "recipes/synthesize_data.py"), f"output={out}", "num_tasks=60", "seed=3"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def tokenizer(tasks) -> Path:
    """A tokenizer folder with Qwen3's special tokens and chat template, as the recipe's import carries one: the
    embedded tokenizer trained on the task files' text."""
    from nemo_orchestra.data.default_tasks import plan_phrases
    from nemo_orchestra.prompting.chat import QWEN3_CHAT_TEMPLATE
    from nemo_orchestra.prompting.tokenizer import build_embedded_tokenizer

    corpus = (tasks / "train.jsonl").read_text().splitlines()
    tok = build_embedded_tokenizer(corpus, phrases=plan_phrases())
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    tok.save_pretrained(tasks / "tokenizer")
    return tasks / "tokenizer"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("recipe", ["qwen3_8b_1n8g", "qwen3_8b_2n8g"])
def test_an_8b_recipe_runs_as_its_twin_on_two_ranks(tmp_path, tasks, tokenizer, recipe):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONWARNINGS"] = "ignore"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "recipes/grpo_orchestrator.py"), f"recipe={recipe}", *TWIN, f"run.output_dir={out}"]
    cmd += [f"data.train_path={tasks / 'train.jsonl'}", f"data.eval_path={tasks / 'eval.jsonl'}"]
    cmd += [f"model.tokenizer={tokenizer}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=840, cwd=ROOT, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    config = (out / "config.yaml").read_text()
    for kept in ("tp: 2", "kl_coef: 0.0001", "lr: 1.0e-06", "activation_recompute: true", "offload: true"):
        assert kept in config, kept  # the recipe's own settings ran
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["rollout/turns_mean"] >= 1 for row in rows), [row["rollout/turns_mean"] for row in rows]
    assert (out / "checkpoints" / "latest").is_file() and (out / "hf" / "config.json").is_file()
    assert json.loads((out / "eval.json").read_text())
