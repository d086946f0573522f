"""The generation engines are registered once (``rollout/engine_registry.py``): the config's valid names are the
registry's, and each engine's class is where its spec says, carrying the spec's capabilities."""

import importlib

import pytest

from nemo_orchestra.config import ConfigError, load_config
from nemo_orchestra.rollout.engine_registry import ENGINES
from nemo_orchestra.rollout.engines import capabilities


def test_the_config_takes_the_registrys_names_and_no_other():
    assert sorted(ENGINES) == ["hf", "megatron", "megatron_copy", "vllm"]
    with pytest.raises(
        ConfigError, match=r"rollout.engine: must be one of \['hf', 'megatron', 'megatron_copy', 'vllm'\]"
    ):
        load_config(["rollout.engine=nope"])
    with pytest.raises(ValueError, match=r"rollout.engine: unknown engine 'nope'; choose one of \['hf', 'megatron'"):
        capabilities("nope")


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_each_engine_class_is_where_its_spec_says_with_its_capabilities(name):
    spec = ENGINES[name]
    module, cls = spec.cls.split(":")
    engine = getattr(importlib.import_module(module), cls)  # the module only: vLLM itself is imported at build
    assert engine.capabilities is spec.capabilities == capabilities(name)
    assert callable(engine.create)


def test_rollouts_ahead_need_an_engine_with_its_own_weights():
    with pytest.raises(
        ConfigError, match=r"rollout.steps_ahead: .*\(vllm or hf or megatron_copy\): the megatron engine"
    ):
        load_config(["rollout.steps_ahead=1", "loss.tis_cap=2.0", "rollout.engine=megatron"])
