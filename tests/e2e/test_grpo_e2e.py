"""The main job end to end: a real tool service, warm start, 2 GRPO steps, checkpoint, export."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = [
    "step",
    "reward/mean",
    "reward/outcome",
    "rollout/cost_mean",
    "rollout/latency_mean",
    "rollout/turns_mean",
    "perf/tokens_per_s",
    "time/rollout_s",
    "time/train_s",
]
SMALL = [
    "warm_start.steps=10",
    "data.num_train_tasks=48",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_turns=2",
    "rollout.engine=hf",
    "data.num_eval_tasks=6",
    "evaluation.samples=2",
]  # the vllm engine has its own end-to-end test


def _run(args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CPU path, as users run it
    env["PYTHONWARNINGS"] = "ignore"
    r = subprocess.run(
        [sys.executable, str(ROOT / "recipes/grpo_orchestrator.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    _run(["trainer.max_steps=2", f"run.output_dir={out}", *SMALL])
    return out


@pytest.mark.slow
def test_metrics_per_step(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert r["rollout/turns_mean"] >= 1
        assert r["perf/tokens_per_s"] > 0


@pytest.mark.slow
def test_heldout_report_greedy_and_sampled_before_and_after(run_dir):
    evals = json.loads((run_dir / "eval.json").read_text())
    (first, last) = sorted({int(k.split()[1].rstrip(",")) for k in evals})  # 0 and 2 (2 and 3 once resumed)
    assert list(evals) == [f"step {first}", f"step {first}, 2 samples", f"step {last}", f"step {last}, 2 samples"]
    for step in (first, last):
        assert evals[f"step {step}"]["all"]["n"] == 6 and evals[f"step {step}, 2 samples"]["all"]["n"] == 12
    report = (run_dir / "report.md").read_text()
    assert f"| all | step {last}, 2 samples | 12 |" in report
    assert "checkpoint.temperature=0.7 checkpoint.top_p=0.9 samples=2" in report  # how to draw them again


@pytest.mark.slow
def test_checkpoint_and_tokenizer_saved(run_dir):
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_00000002"
    for name in ("metadata.json", "nemo_orchestra.json", "rng_rank_00000.pt"):  # a distributed checkpoint
        assert (run_dir / "checkpoints" / latest / name).is_file(), name
    assert (run_dir / "tokenizer" / "tokenizer.json").is_file()
    assert (run_dir / "config.yaml").is_file()


@pytest.mark.slow
def test_export_loads_in_transformers_offline(run_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = run_dir / "hf"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (hf / name).is_file(), name
    gen = json.loads((hf / "generation_config.json").read_text())  # a server's default: as the rollouts sampled
    assert (gen["do_sample"], gen["temperature"], gen["top_p"]) == (True, 0.7, 0.9)
    tok = AutoTokenizer.from_pretrained(hf, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(hf, local_files_only=True)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.slow
def test_resume_continues_from_the_last_checkpoint(run_dir):
    r = _run(["trainer.max_steps=3", f"run.output_dir={run_dir}", *SMALL])
    assert "resumed from" in r.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


@pytest.mark.slow
def test_evaluate_recomputes_figures_from_the_saved_checkpoint(run_dir, tmp_path):
    from nemo_orchestra.data.default_tasks import generate_tasks

    tasks = tmp_path / "eval.jsonl"
    tasks.write_text("".join(t.to_json() + "\n" for t in generate_tasks(4, seed=99)))
    out = tmp_path / "eval"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes/evaluate.py"),
            f"tasks={tasks}",
            f"output={out}",
            f"policies=checkpoint:{run_dir},cheapest",
            "preferences=record",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    ours = [row for row in results["rows"] if row["policy"].startswith("checkpoint")]
    assert len(ours) == 1 and ours[0]["n"] == 4
    assert 0.0 <= ours[0]["accuracy"] <= 1.0 and ours[0]["mean_cost"] > 0  # its own tokens cost something
