import pytest
from omegaconf import OmegaConf

from nemo_orchestra.config import CONF_DIR, GROUPS, ConfigError, config_keys, load_config


def test_base_file_sets_every_key():
    cfg = OmegaConf.to_container(OmegaConf.structured(load_config([])))
    flat = {k for k in config_keys()}
    for key in flat:
        node = cfg
        for part in key.split("."):
            node = node[part]
    assert {"trainer.max_steps", "run.output_dir", "rollout.group_size", "rollout.max_turns"} <= flat


@pytest.mark.parametrize(
    "path", sorted(p for g in GROUPS for p in (CONF_DIR / g).glob("*.yaml")), ids=lambda p: f"{p.parent.name}/{p.stem}"
)
def test_every_group_file_validates(path):
    load_config([f"{path.parent.name}={path.stem}"])


@pytest.mark.parametrize("path", sorted((CONF_DIR / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_recipe_validates(path):
    load_config([f"recipe={path.stem}"])


def test_overrides_are_typed():
    cfg = load_config(["trainer.max_steps=3", "rollout.temperature=0.5", "model.fp8=null"])
    assert cfg.trainer.max_steps == 3 and cfg.rollout.temperature == 0.5 and cfg.model.fp8 is None


@pytest.mark.parametrize(
    "override,key",
    [
        (["no_such.key=1"], "no_such.key"),
        (["trainer.nope=1"], "trainer.nope"),
        (["trainer.max_steps=abc"], "trainer.max_steps"),
        (["rollout.group_size=1"], "rollout.group_size"),
        (["reference.reset_every=-1"], "reference.reset_every"),
        (["model.attention_backend=cuda"], "model.attention_backend"),
        (["model=giant"], "model=giant"),
        (["trainer.max_steps"], "trainer.max_steps"),
    ],
)
def test_bad_overrides_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(override)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["rollout.steps_ahead=1"], "loss.tis_cap"),  # stale rollouts need the behaviour-policy correction
        (["rollout.steps_ahead=1", "loss.tis_cap=2.0", "rollout.engine=megatron"], "rollout.steps_ahead"),
        (  # its forwards span the TP group, whose other ranks are training
            ["rollout.steps_ahead=1", "loss.tis_cap=2.0", "rollout.engine=megatron_copy", "parallel=tp2"],
            "needs parallel.tp=1 with rollout.engine=megatron_copy",
        ),
        (["rollout.steps_ahead=-1"], "rollout.steps_ahead"),
        (["rollout.max_extra_prompts=-1"], "rollout.max_extra_prompts"),
    ],
)
def test_rollouts_ahead_refuse_what_they_cannot_correct(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(overrides)
    assert load_config(["rollout.steps_ahead=1", "loss.tis_cap=2.0"]).rollout.steps_ahead == 1
    ahead = load_config(["rollout.steps_ahead=1", "loss.tis_cap=2.0", "rollout.engine=megatron_copy"])
    assert ahead.rollout.engine == "megatron_copy" and ahead.rollout.steps_ahead == 1
