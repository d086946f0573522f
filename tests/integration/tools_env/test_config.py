"""ServiceConfig: working defaults, unknown keys named, YAML/JSON files."""

import json

import pytest

from tools_env.service_config import ServiceConfig


def test_empty_config_is_a_working_offline_service():
    cfg = ServiceConfig.from_dict({})
    g = cfg.guards
    assert (g.max_turns, g.max_cost, g.max_wall_s) == (30, 1.0, 600.0)
    assert cfg.experts.aliases == ["expert-small", "expert-medium", "expert-large"]
    large = cfg.experts.simulated["expert-large"]
    assert (large.price_in, large.price_out) == (1.25, 10.0)
    assert large.accuracy["arithmetic"] == 0.95 and large.accuracy["default"] == 0.9
    assert cfg.experts.sleep is False and cfg.judge is None


@pytest.mark.parametrize(
    "d, words",
    [
        ({"bogus": 1}, "'bogus'"),
        ({"guards": {"max_turn": 3}}, "'guards.max_turn'"),
        ({"guards": {"max_turns": "3"}}, "'guards.max_turns' must be int"),
        ({"guards": {"max_turns": 0}}, "'guards.max_turns' must be >= 1"),
        ({"guards": {"max_cost": -1}}, "'guards.max_cost' must be >= 0"),
        (
            {
                "experts": {
                    "simulated": {
                        "s": {"price_in": 1, "price_out": 1, "accuracy": {"x": 0.5}, "latency_s": 1, "output_tokens": 5}
                    }
                }
            },
            "needs a 'default'",
        ),
        (
            {
                "experts": {
                    "simulated": {
                        "s": {"price_in": 1, "price_out": 1, "accuracy": 1.5, "latency_s": 1, "output_tokens": 5}
                    }
                }
            },
            "probability",
        ),
        ({"experts": {"simulated": {"s": {"price_in": 1}}}}, "missing 'price_out'"),
        (
            {
                "experts": {
                    "endpoints": {
                        "e": {"base_url": "http://x/v1", "model": "m", "price_in": 1, "price_out": 1, "timeout": 3}
                    }
                }
            },
            "'experts.endpoints.e.timeout'",
        ),
        ({"python": {"memory": 3}}, "'python.memory'"),
        ({"python": {"warm": "yes"}}, "'python.warm' must be bool"),
        ({"judge": {"model": "m"}}, "missing 'base_url'"),
    ],
)
def test_bad_configs_name_the_key(d, words):
    with pytest.raises(ValueError) as e:
        ServiceConfig.from_dict(d)
    assert words in str(e.value)


def test_an_experts_section_replaces_the_simulated_defaults():
    cfg = ServiceConfig.from_dict(
        {
            "experts": {
                "endpoints": {"gpt": {"base_url": "http://h/v1", "model": "gpt-5", "price_in": 1.25, "price_out": 10}}
            }
        }
    )
    assert cfg.experts.aliases == ["gpt"]
    with pytest.raises(ValueError, match="both an endpoint and simulated"):
        ServiceConfig.from_dict(
            {
                "experts": {
                    "endpoints": {"a": {"base_url": "u", "model": "m", "price_in": 1, "price_out": 1}},
                    "simulated": {
                        "a": {"price_in": 1, "price_out": 1, "accuracy": 0.5, "latency_s": [1, 2], "output_tokens": 10}
                    },
                }
            }
        )


def test_an_experts_key_keeps_the_default_table():
    default = ServiceConfig.from_dict({}).experts
    cfg = ServiceConfig.from_dict({"experts": {"sleep": True, "sleep_scale": 0.1}})
    assert cfg.experts.sleep and cfg.experts.sleep_scale == 0.1
    assert cfg.experts.simulated == default.simulated and len(default.simulated) == 3


def test_latency_ranges_and_files(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text(
        "seed: 7\nexperts:\n  sleep: true\n  simulated:\n    s: {price_in: 1, price_out: 2, "
        "accuracy: 0.5, latency_s: {default: [1, 2], lookup: 0.5}, output_tokens: 10}\n"
    )
    cfg = ServiceConfig.load(str(y))
    s = cfg.experts.simulated["s"]
    assert cfg.seed == 7 and s.latency_s == {"default": (1.0, 2.0), "lookup": (0.5, 0.5)}
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"guards": {"ttl_s": 5}}))
    assert ServiceConfig.load(str(j)).guards.ttl_s == 5.0
