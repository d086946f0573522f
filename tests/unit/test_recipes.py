"""The recipes: each sets every key that shapes its training itself, the 8B recipes resolve to what is pinned
here, and no recipe's tuning reaches another by inheritance."""

import shutil
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from nemo_orchestra.config import (
    CONF_DIR,
    REMOVED_KEYS,
    REMOVED_LOG,
    ConfigError,
    choices,
    config_keys,
    load_config,
    to_dict,
)

ROOT = Path(__file__).resolve().parents[2]
PINNED = ROOT / "tests" / "fixtures" / "recipes"
RECIPES = sorted(p.stem for p in (CONF_DIR / "recipes").glob("*.yaml"))
PRODUCT = ["qwen3_8b_1n8g", "qwen3_8b_2n8g", "qwen3_8b_tau2"]
# the sections whose every key a recipe sets itself (in its files or in the group files it names)
TRAINING_SECTIONS = ("data", "rollout", "reward", "advantage", "loss", "optim", "warm_start", "trainer", "reference")


def _keys_set(path: Path, prefix: str = "") -> set[str]:
    tree = OmegaConf.to_container(OmegaConf.load(path))
    tree.pop("defaults", None)
    out = set()

    def walk(node, at):
        for k, v in node.items():
            if isinstance(v, dict) and v and f"{at}{k}" != "tools.service":
                walk(v, f"{at}{k}.")
            else:
                out.add(f"{at}{k}")

    walk(tree, prefix)
    return out


def _set_by_recipe(name: str) -> set[str]:
    chain, groups = choices([f"recipe={name}"])
    keys = set()
    for r in chain:
        keys |= _keys_set(CONF_DIR / "recipes" / f"{r}.yaml")
        named = (OmegaConf.load(CONF_DIR / "recipes" / f"{r}.yaml").get("defaults") or {}).keys()
        for g in named:
            if g != "recipe":
                keys |= _keys_set(CONF_DIR / g / f"{groups[g]}.yaml", f"{g}.")
    # a mapping's entries (reward.default_preference.accuracy) count for the mapping
    return keys | {k.rsplit(".", 1)[0] for k in keys if k.count(".") > 1}


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_sets_every_key_that_shapes_training(name):
    wanted = {k for k in config_keys() if k.split(".")[0] in TRAINING_SECTIONS}
    missing = sorted(wanted - _set_by_recipe(name))
    assert not missing, f"recipe {name} leaves these to the base file: {missing}"
    assert "model" in OmegaConf.load(CONF_DIR / "recipes" / f"{choices([f'recipe={name}'])[0][0]}.yaml").defaults


@pytest.mark.parametrize("name", PRODUCT)
def test_an_8b_recipe_resolves_to_what_is_pinned(name):
    """A change anywhere (base file, group files, the recipe) that moves an 8B run shows here; write the pins
    again (``python -m tests.unit.test_recipes``) only for a change meant for the 8B run."""
    pinned = yaml.safe_load((PINNED / f"{name}.yaml").read_text())
    now = to_dict(load_config([f"recipe={name}"]))
    diffs = [
        f"{k}: pinned {pinned[s][k]!r}, now {now[s][k]!r}"
        for s in pinned
        for k in pinned[s]
        if pinned[s][k] != now[s][k]
    ]
    assert not diffs and pinned.keys() == now.keys(), diffs


@pytest.mark.parametrize("name", PRODUCT)
def test_the_cpu_defaults_tuning_never_reaches_an_8b_recipe(tmp_path, name):
    """Every value of the CPU default's recipe changed: the 8B recipes resolve as before, the default does not."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    tiny = yaml.safe_load((conf / "recipes" / "tiny_cpu.yaml").read_text())

    def bump(v):
        if isinstance(v, bool):
            return not v
        if isinstance(v, int):
            return v + 1 if v else v  # 0 stays off: turning an option on can need another key
        if isinstance(v, float):
            return v / 2
        return v

    for section, values in tiny.items():
        if section != "defaults":
            tiny[section] = {k: bump(v) for k, v in values.items()}
    (conf / "recipes" / "tiny_cpu.yaml").write_text(yaml.safe_dump(tiny))
    assert to_dict(load_config([f"recipe={name}"], conf_dir=conf)) == to_dict(load_config([f"recipe={name}"]))
    assert load_config([], conf_dir=conf).trainer.max_steps == load_config([]).trainer.max_steps + 1


def test_no_recipe_named_is_the_cpu_default():
    assert choices([])[0] == ["tiny_cpu"] and to_dict(load_config([])) == to_dict(load_config(["recipe=tiny_cpu"]))
    assert choices(["recipe=qwen3_8b_2n8g"])[0] == ["qwen3_8b_1n8g", "qwen3_8b_2n8g"]
    assert choices(["recipe=qwen3_8b_1n8g", "parallel=single"])[1]["parallel"] == "single"  # the command line wins


def test_bad_recipes_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"recipe=nope: no such recipe file; choose one of \['qwen3_8b_1n8g'"):
        load_config(["recipe=nope"])
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "recipes" / "a.yaml").write_text("defaults:\n  recipe: b\n")
    (conf / "recipes" / "b.yaml").write_text("defaults:\n  recipe: a\n")
    with pytest.raises(ConfigError, match="recipe=a: its recipes name each other in a loop"):
        load_config(["recipe=a"], conf_dir=conf)
    (conf / "recipes" / "c.yaml").write_text("data:\n  prompts_per_step: 2\n")
    with pytest.raises(ConfigError, match="defaults.model: no model group chosen"):
        load_config(["recipe=c"], conf_dir=conf)


@pytest.mark.parametrize("key", sorted(REMOVED_KEYS))
def test_removed_options_are_refused_by_name_with_the_log(tmp_path, key):
    with pytest.raises(ConfigError, match=rf"{key}: removed .* {REMOVED_LOG}"):
        load_config([f"{key}=false"])
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    tiny = yaml.safe_load((conf / "recipes" / "tiny_cpu.yaml").read_text())
    section, leaf = key.split(".")
    tiny[section][leaf] = False
    (conf / "recipes" / "tiny_cpu.yaml").write_text(yaml.safe_dump(tiny))
    with pytest.raises(ConfigError, match=rf"{key}: removed .*conf/recipes/tiny_cpu.yaml"):
        load_config([], conf_dir=conf)
    assert key in (ROOT / REMOVED_LOG).read_text(), f"{REMOVED_LOG} has no entry for {key}"


@pytest.mark.parametrize(
    "old,new",
    [
        ("sft.steps", "warm_start.steps"),
        ("sft.copy_episodes", "warm_start.copy_lessons"),
        ("sft.copy_batch_size", "warm_start.copy_lessons_per_step"),
        ("rollout.max_staleness", "rollout.steps_ahead"),
        ("loss.lesson_coef", "loss.copy_lesson_coef"),
        ("loss.lesson_batch_size", "loss.copy_lessons_per_step"),
    ],
)
def test_renamed_keys_are_refused_naming_the_new_name(tmp_path, old, new):
    with pytest.raises(ConfigError, match=rf"^{old}: renamed {new} \(set in the command line\)"):
        load_config([f"{old}=1"])
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    with open(conf / "recipes" / "tiny_cpu.yaml", "a") as f:
        f.write("\nsft:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=r"^sft: renamed warm_start \(set in conf/recipes/tiny_cpu.yaml\)"):
        load_config([], conf_dir=conf)
    load_config([f"{new}=0"])  # the new name is taken


def pin(name: str) -> str:
    """What ``tests/fixtures/recipes/NAME.yaml`` holds."""
    head = f"# What recipe={name} resolves to (tests/unit/test_recipes.py).\n"
    return head + yaml.safe_dump(to_dict(load_config([f"recipe={name}"])), sort_keys=True)


if __name__ == "__main__":  # python -m tests.unit.test_recipes: write the pins again, after a change meant for them
    for name in PRODUCT:
        (PINNED / f"{name}.yaml").write_text(pin(name))
