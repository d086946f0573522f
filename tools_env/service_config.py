"""Typed configuration of the tool-environment service.

``ServiceConfig.from_dict({})`` is a working offline service: guards, a seed and three
simulated experts. Unknown keys anywhere are a ``ValueError`` naming the dotted key. Every section
merges with its defaults key by key (``guards: {max_turns: 5}`` keeps the other guards); the expert
tables are the exception: a ``simulated`` or ``endpoints`` table that is given is the whole table.

```yaml
seed: 0
max_request_bytes: 1048576        # aiohttp client_max_size
workdir_root: null                # parent of the per-episode workdirs (default: system temp)
guards: {max_turns: 30, max_cost: 1.0, max_wall_s: 600, ttl_s: 900, gc_interval_s: 5, max_episodes: 100000}
experts:                          # sleep/sleep_scale alone keep the default experts; a table given is the whole table
  sleep: false                    # simulated experts really wait their latency ...
  sleep_scale: 1.0                # ... scaled by this factor
  endpoints:                      # OpenAI-compatible chat endpoints
    gpt-5: {base_url: http://host:8000/v1, model: gpt-5, price_in: 1.25, price_out: 10, api_key_env: OPENAI_API_KEY}
  simulated:                      # offline stand-ins, per task category with a `default`
    expert-small: {price_in: 0.2, price_out: 0.2, accuracy: {default: 0.5}, latency_s: {default: [1, 2]},
                   output_tokens: {default: 150}, evidence_accuracy: {default: 1.0}}  # the last: optional
python: {cpu_time_s: 10, wall_time_s: 15, memory_mb: 512, max_concurrency: 0, warm: true,
         require_fs_allowlist: false}  # true: refuse to start unless the sandbox hides the host's files
judge: null                       # or {base_url, model, api_key_env, max_answer_chars: 2000}
user: null                        # the simulated user of conversational (tau2) tasks: an endpoint like an expert's
                                  # ({base_url, model, price_in, price_out, ...}), or "replay" (the task's gold script)
tools: {}                         # free-form sections for other plug-ins, by tool name
```
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

PYTHON_PRICE_PER_S = 0.0000083  # $ per second of code execution (ToolOrchestra)


def _check_keys(cls: type, d: Any, path: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ValueError(f"config '{path}' must be a mapping, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    for key in d:
        if key not in known:
            where = f"{path}.{key}" if path else key
            raise ValueError(f"unknown config key '{where}'; valid keys: {', '.join(sorted(known))}")
    return d


def _scalar(value: Any, typ: type, path: str, *, minimum: float | None = None) -> Any:
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ in (int, float) and isinstance(value, bool) or not isinstance(value, typ):
        raise ValueError(f"config '{path}' must be {typ.__name__}, got {value!r}")
    if minimum is not None and typ in (int, float) and value < minimum:
        raise ValueError(f"config '{path}' must be >= {minimum}, got {value!r}")
    return value


def _fill(cls: type, d: dict[str, Any], path: str, minimum: float | None = 0) -> dict[str, Any]:
    """Type-check the scalar fields of ``cls`` present in ``d``; nested fields are left to the caller."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        typ = {"int": int, "float": float, "bool": bool, "str": str}.get(str(f.type).split(" |")[0])
        value = d[f.name]
        if typ is None or (value is None and "None" in str(f.type)):
            out[f.name] = value
        else:
            out[f.name] = _scalar(value, typ, f"{path}.{f.name}".lstrip("."), minimum=minimum)
    return out


@dataclass
class GuardConfig:
    max_turns: int = 30
    max_cost: float = 1.0  # $ per episode
    max_wall_s: float = 600.0  # from creation
    ttl_s: float = 900.0  # idle time after which an episode expires
    gc_interval_s: float = 5.0
    max_episodes: int = 100_000  # live episodes per process; more is a 503

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_episodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"config 'guards.{name}' must be >= 1")
        for name in ("max_wall_s", "ttl_s", "gc_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config 'guards.{name}' must be > 0")

    @classmethod
    def from_dict(cls, d: Any, path: str = "guards") -> "GuardConfig":
        return cls(**_fill(cls, _check_keys(cls, d, path), path))


def _per_category(value: Any, path: str, typ: type) -> dict[str, Any]:
    """A number (all categories) or ``{category: value, ..., "default": value}``."""
    if not isinstance(value, dict):
        value = {"default": value}
    if "default" not in value:
        raise ValueError(f"config '{path}' needs a 'default' entry for unlisted categories")
    out = {}
    for cat, v in value.items():
        if typ is tuple:  # latency: seconds, or [low, high] drawn uniformly
            pair = v if isinstance(v, (list, tuple)) else [v, v]
            if len(pair) != 2:
                raise ValueError(f"config '{path}.{cat}' must be seconds or [low, high]")
            lo, hi = (_scalar(x, float, f"{path}.{cat}", minimum=0) for x in pair)
            if hi < lo:
                raise ValueError(f"config '{path}.{cat}' has high < low")
            out[cat] = (lo, hi)
        else:
            out[cat] = _scalar(v, typ, f"{path}.{cat}", minimum=0)
            if typ is float and out[cat] > 1:
                raise ValueError(f"config '{path}.{cat}' is a probability, must be <= 1")
    return out


@dataclass
class SimulatedExpertConfig:
    """An offline stand-in for an expert model; everything it reports is simulated."""

    price_in: float  # $ per 1M input tokens
    price_out: float  # $ per 1M output tokens
    accuracy: dict[str, float]  # P(correct) by task category
    latency_s: dict[str, tuple[float, float]]  # reported latency range by category
    output_tokens: dict[str, int]  # simulated completion tokens by category
    prompt_overhead_tokens: int = 200  # added to len(query) / 4 for input tokens
    # P(correct) by category of an answer it writes with the task's evidence found (``meta.evidence``:
    # the documents the answer follows from); at least ``accuracy``. An answer a tool result states is
    # copied, always right.
    evidence_accuracy: dict[str, float] = field(default_factory=lambda: {"default": 1.0})

    @classmethod
    def from_dict(cls, d: Any, path: str) -> "SimulatedExpertConfig":
        d = _check_keys(cls, d, path)
        for key in ("price_in", "price_out", "accuracy", "latency_s", "output_tokens"):
            if key not in d:
                raise ValueError(f"config '{path}' is missing '{key}'")
        kw = _fill(cls, d, path)
        kw["accuracy"] = _per_category(d["accuracy"], f"{path}.accuracy", float)
        kw["latency_s"] = _per_category(d["latency_s"], f"{path}.latency_s", tuple)
        kw["output_tokens"] = _per_category(d["output_tokens"], f"{path}.output_tokens", int)
        if "evidence_accuracy" in d:
            kw["evidence_accuracy"] = _per_category(d["evidence_accuracy"], f"{path}.evidence_accuracy", float)
        return cls(**kw)


def for_category(per_category: dict[str, Any], category: str) -> Any:
    """A per-category setting's value for ``category``, or its ``default``."""
    return per_category.get(category, per_category["default"])


@dataclass
class EndpointExpertConfig:
    """An OpenAI-compatible chat endpoint (vLLM, NIM, a hosted API)."""

    base_url: str  # up to and including /v1
    model: str
    price_in: float
    price_out: float
    api_key_env: str | None = None  # name of the env var holding the bearer key
    timeout_s: float = 120.0  # deadline for the whole call, retries included
    max_retries: int = 3
    backoff_s: float = 0.5  # first retry delay, doubled each time
    max_tokens: int | None = None
    temperature: float | None = None
    system_prompt: str | None = None
    latency_hint_s: float | None = None  # shown to the policy in the price table

    @classmethod
    def from_dict(cls, d: Any, path: str) -> "EndpointExpertConfig":
        d = _check_keys(cls, d, path)
        for key in ("base_url", "model", "price_in", "price_out"):
            if key not in d:
                raise ValueError(f"config '{path}' is missing '{key}'")
        return cls(**_fill(cls, d, path))


def _default_simulated() -> dict[str, SimulatedExpertConfig]:
    def sim(price, acc, lat, out, with_evidence):
        return SimulatedExpertConfig.from_dict(
            {
                "price_in": price[0],
                "price_out": price[1],
                "accuracy": acc,
                "latency_s": lat,
                "output_tokens": out,
                "evidence_accuracy": with_evidence,
            },
            "experts.simulated",
        )

    # multistep: two facts to recall and a difference to take (the default task set's FRAMES-shaped
    # category), which only the strong expert gets right reliably; with both documents found the
    # recall is done, the difference still slips a smaller model
    cats = ("arithmetic", "lookup", "reasoning", "multistep", "default")
    return {  # priced like Qwen2.5-Math-7B, Qwen3-32B and gpt-5 respectively
        "expert-small": sim(
            (0.2, 0.2),
            dict(zip(cats, (0.5, 0.8, 0.2, 0.1, 0.5))),
            {"default": [1.0, 2.0]},
            dict(zip(cats, (120, 40, 200, 150, 120))),
            {"multistep": 0.9, "default": 1.0},
        ),
        "expert-medium": sim(
            (0.8, 0.8),
            dict(zip(cats, (0.7, 0.9, 0.6, 0.3, 0.7))),
            {"default": [3.0, 4.0]},
            dict(zip(cats, (250, 80, 400, 300, 250))),
            {"multistep": 0.95, "default": 1.0},
        ),
        "expert-large": sim(
            (1.25, 10.0),
            dict(zip(cats, (0.95, 0.98, 0.9, 0.95, 0.9))),
            {"default": [8.0, 10.0]},
            dict(zip(cats, (500, 200, 900, 600, 500))),
            {"default": 1.0},
        ),
    }


@dataclass
class ExpertsConfig:
    endpoints: dict[str, EndpointExpertConfig] = field(default_factory=dict)
    simulated: dict[str, SimulatedExpertConfig] = field(default_factory=_default_simulated)
    sleep: bool = False  # simulated experts really wait their (scaled) latency
    sleep_scale: float = 1.0
    max_observation_chars: int = 8000

    @classmethod
    def from_dict(cls, d: Any, path: str = "experts") -> "ExpertsConfig":
        d = _check_keys(cls, d, path)
        kw = _fill(cls, {k: v for k, v in d.items() if k not in ("endpoints", "simulated")}, path)
        kw["endpoints"] = {
            a: EndpointExpertConfig.from_dict(v, f"{path}.endpoints.{a}")
            for a, v in _check_map(d.get("endpoints", {}), f"{path}.endpoints").items()
        }
        if "simulated" in d:  # a section that is given replaces the default table; one left out keeps it
            kw["simulated"] = {
                a: SimulatedExpertConfig.from_dict(v, f"{path}.simulated.{a}")
                for a, v in _check_map(d["simulated"], f"{path}.simulated").items()
            }
        elif kw["endpoints"]:  # endpoints alone: the run uses real experts only
            kw["simulated"] = {}
        clash = sorted(set(kw["endpoints"]) & set(kw.get("simulated", {})))
        if clash:
            raise ValueError(f"expert alias(es) {clash} are both an endpoint and simulated")
        return cls(**kw)

    @property
    def aliases(self) -> list[str]:
        return [*self.endpoints, *self.simulated]


def _check_map(d: Any, path: str) -> dict[str, Any]:
    if not isinstance(d, dict) or not all(isinstance(k, str) and k for k in d):
        raise ValueError(f"config '{path}' must map names to sections")
    return d


@dataclass
class PythonConfig:
    """Limits handed to ``tools_env.sandbox.run_python`` plus the tool's own knobs."""

    cpu_time_s: float = 10.0
    wall_time_s: float = 15.0
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 65536
    file_size_mb: int = 16
    network: bool = False
    max_concurrency: int = 0  # sandbox runs at once per process; 0 = 8 x CPU count (warm), 2 x (cold)
    price_per_s: float = PYTHON_PRICE_PER_S
    warm: bool = True  # fork runs from a waiting sandbox interpreter; False: fresh interpreters per run
    require_fs_allowlist: bool = False  # refuse to start where the sandbox cannot hide the host's files

    @classmethod
    def from_dict(cls, d: Any, path: str = "python") -> "PythonConfig":
        return cls(**_fill(cls, _check_keys(cls, d, path), path))

    def sandbox_limits(self) -> dict[str, Any]:
        skip = ("max_concurrency", "price_per_s", "warm", "require_fs_allowlist")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}


@dataclass
class JudgeConfig:
    """An OpenAI-compatible endpoint that grades answers the exact/numeric checks cannot."""

    base_url: str
    model: str
    api_key_env: str | None = None
    timeout_s: float = 60.0
    max_retries: int = 2
    backoff_s: float = 0.5
    max_answer_chars: int = 2000  # the predicted answer is cut to this many characters (and the judge told so)

    @classmethod
    def from_dict(cls, d: Any, path: str = "judge") -> "JudgeConfig":
        d = _check_keys(cls, d, path)
        for key in ("base_url", "model"):
            if key not in d:
                raise ValueError(f"config '{path}' is missing '{key}'")
        cfg = cls(**_fill(cls, d, path))
        if cfg.max_answer_chars < 1:
            raise ValueError(f"config '{path}.max_answer_chars' must be >= 1, got {cfg.max_answer_chars}")
        return cfg


@dataclass
class ServiceConfig:
    seed: int = 0
    max_request_bytes: int = 1 << 20
    workdir_root: str | None = None
    guards: GuardConfig = field(default_factory=GuardConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    python: PythonConfig = field(default_factory=PythonConfig)
    judge: JudgeConfig | None = None
    user: EndpointExpertConfig | str | None = None  # an endpoint, "replay", or None (no conversational tasks)
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any) -> "ServiceConfig":
        d = _check_keys(cls, d if d is not None else {}, "")
        kw = _fill(cls, {k: d[k] for k in ("seed", "max_request_bytes", "workdir_root") if k in d}, "")
        if "guards" in d:
            kw["guards"] = GuardConfig.from_dict(d["guards"])
        if "experts" in d:
            kw["experts"] = ExpertsConfig.from_dict(d["experts"])
        if "python" in d:
            kw["python"] = PythonConfig.from_dict(d["python"])
        if d.get("judge") is not None:
            kw["judge"] = JudgeConfig.from_dict(d["judge"])
        if d.get("user") is not None:
            kw["user"] = "replay" if d["user"] == "replay" else EndpointExpertConfig.from_dict(d["user"], "user")
        if "tools" in d:
            kw["tools"] = _check_map(d["tools"], "tools")
        return cls(**kw)

    @classmethod
    def load(cls, path: str | None) -> "ServiceConfig":
        """Read a ``.json`` or ``.yaml``/``.yml`` file (None gives the defaults)."""
        if path is None:
            return cls()
        with open(path) as f:
            text = f.read()
        if os.path.splitext(path)[1] in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        return cls.from_dict(data or {})
