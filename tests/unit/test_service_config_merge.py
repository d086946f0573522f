"""Every section of the tool service's config merges with its defaults key by key: setting one key
(in a service config file, or as ``tools.service.SECTION.KEY=value`` on the main job's command
line) changes that key and keeps every other default of the section."""

import dataclasses

import pytest

from nemo_orchestra.config import load_config
from tools_env.service_config import ServiceConfig

DEFAULT = ServiceConfig.from_dict({})
SECTIONS = [f.name for f in dataclasses.fields(ServiceConfig) if dataclasses.is_dataclass(getattr(DEFAULT, f.name))]
SCALARS = [
    (s, f.name)
    for s in SECTIONS
    for f in dataclasses.fields(getattr(DEFAULT, s))
    if isinstance(getattr(getattr(DEFAULT, s), f.name), (bool, int, float))
]


def _changed(value):
    if isinstance(value, bool):
        return not value
    return value * 2 if value else 1


def test_every_dataclass_section_is_covered():
    assert {"guards", "experts", "python"} <= set(SECTIONS)
    assert {s for s, _ in SCALARS} == set(SECTIONS)


@pytest.mark.parametrize("section,key", SCALARS, ids=[f"{s}.{k}" for s, k in SCALARS])
def test_one_key_of_a_section_keeps_the_others(section, key):
    value = _changed(getattr(getattr(DEFAULT, section), key))
    cfg = ServiceConfig.from_dict({section: {key: value}})
    assert getattr(cfg, section) == dataclasses.replace(getattr(DEFAULT, section), **{key: value})
    assert all(getattr(cfg, s) == getattr(DEFAULT, s) for s in SECTIONS if s != section)


@pytest.mark.parametrize("section,key", SCALARS, ids=[f"{s}.{k}" for s, k in SCALARS])
def test_the_main_jobs_overrides_merge_the_same_way(section, key):
    value = _changed(getattr(getattr(DEFAULT, section), key))
    service = load_config([f"tools.service.{section}.{key}={str(value).lower()}"]).tools.service_config()
    recipe_tools = load_config([]).tools.service_config().tools  # the default recipe's tool sections
    assert service == ServiceConfig.from_dict({section: {key: value}, "tools": recipe_tools})


def test_top_level_keys_keep_the_sections():
    cfg = ServiceConfig.from_dict({"seed": 3, "tools": {"search": {"corpus": "c.jsonl"}}})
    assert (cfg.seed, cfg.tools) == (3, {"search": {"corpus": "c.jsonl"}})
    assert all(getattr(cfg, s) == getattr(DEFAULT, s) for s in SECTIONS)
    assert cfg.max_request_bytes == DEFAULT.max_request_bytes and cfg.judge is None
