"""``--help`` on every recipe: what it does, its launch lines, and every key it takes with its default
and type, generated from the config dataclasses (so a key added to the schema shows up by itself)."""

import subprocess
import sys
from pathlib import Path

import pytest

from nemo_orchestra.config import config_keys, load_config, to_dict
from nemo_orchestra.config_help import _leaf_keys, recipe_help

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.py"))


def _help(script: str, *args: str) -> str:
    r = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / script), *args, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _value_of(text: str, key: str) -> str:
    line = next(line for line in text.splitlines() if line.strip().startswith(f"{key} = "))
    return line.split(" = ", 1)[1].split()[0]


@pytest.mark.parametrize("script", RECIPES)
def test_every_recipe_answers_help(script):
    text = _help(script) if script != "benchmark.py" else _help(script, "grpo")
    assert "python recipes/" in text or "usage: benchmark.py" in text  # launch lines / usage
    if script != "benchmark.py":
        first = (ROOT / "recipes" / script).read_text().split('"""')[1].strip().splitlines()[0]
        assert text.startswith(first)  # the recipe's docstring: what it does


def test_main_help_lists_every_key_with_its_default():
    text = recipe_help("doc", main=True)
    defaults = to_dict(load_config([]))
    for key in config_keys():
        node = defaults
        for part in key.split("."):
            node = node[part]
        if isinstance(node, bool):
            assert _value_of(text, key) == str(node).lower(), key
        elif isinstance(node, (int, float, str)) or node is None:
            assert _value_of(text, key) == ("null" if node is None else str(node) or '""'), key
        else:
            assert f"  {key} = " in text, key


def test_help_shows_the_values_after_overrides_and_the_recipe_file():
    text = _help("grpo_orchestrator.py", "recipe=qwen3_8b_1n8g", "trainer.max_steps=7")
    assert _value_of(text, "trainer.max_steps") == "7"
    assert _value_of(text, "model.hidden_size") == "4096"  # from conf/model/qwen3_8b.yaml, chosen by the recipe
    assert "model=NAME  one of qwen3_8b, tiny (now: qwen3_8b)" in text


def test_comments_come_from_the_dataclass_and_the_yaml():
    text = recipe_help("doc", main=True)
    line = next(line for line in text.splitlines() if line.strip().startswith("rollout.group_size = "))
    assert line.split()[3:5] == ["int", "#"] and "G trajectories per prompt" in line  # conf/grpo_orchestrator.yaml
    line = next(line for line in text.splitlines() if line.strip().startswith("model.fp8_recipe = "))
    assert "delayed | tensorwise" in line


def test_a_recipes_own_keys_come_first():
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        from export_checkpoint import ExportArgs
    finally:
        sys.path.pop(0)
    text = recipe_help("Export.", ExportArgs, main=True)
    own = [k for k, _ in _leaf_keys(ExportArgs)]
    assert own == ["checkpoint", "output", "tokenizer", "dtype", "format", "tp"]
    positions = [text.index(f"  {k} = ") for k in own] + [text.index("  run.output_dir = ")]
    assert positions == sorted(positions)
    assert _value_of(text, "dtype") == "null"
