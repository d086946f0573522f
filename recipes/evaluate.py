"""Evaluate policies on a task file through the tool service: accuracy, cost, latency, utility, Pareto plot.

Runs every policy under every preference vector on every task (``samples`` times), through a
tool service it starts itself (or the one at ``tools_env.url``), and writes results.json (the rows,
and each task category's own rows: a tau2 domain's pass^k, cost, latency and wall time per episode),
results.csv (one row per policy x preference), episodes.jsonl and pareto.png (the
accuracy-cost plane with each row's point and the Pareto front); for tau2 tasks also
tau2_<domain>_<policy>_<preference>.json, in tau2-bench's own Results format. When the task file sits in a
folder written by synthesize_data.py, the service's search tool is pointed at its corpus.

Policies: strongest, cheapest, random[:SEED], oracle (replays the gold actions: a data check),
openai:URL:MODEL (an OpenAI-compatible chat model), checkpoint:DIR (a trained run folder or its hf/ export).
Preferences: record (each record's own vector), accuracy (1/0/0), balanced (1/1/0.5),
cost (0.5/1/0), or inline ACC/COST/LAT weights such as 1/0.2/0. The utility of a task is
u = alpha * 1[correct] - (1 - alpha) * cost with alpha = w_acc / (w_acc + w_cost), or ``alpha=``.

Launch:
    python recipes/synthesize_data.py output=data/toolscale seed=0
    python recipes/evaluate.py tasks=data/toolscale/eval.jsonl output=runs/eval \
        policies=strongest,cheapest,random preferences=record,accuracy,cost
    python recipes/evaluate.py tasks=data/toolscale/eval.jsonl output=runs/eval_qwen \
        policies=openai:http://127.0.0.1:8000/v1:Qwen3-8B tools_env.url=http://127.0.0.1:8700
Every policy runs in the agent loop training uses (``nemo_orchestra.rollout.loop``), with the
prompt training uses. A checkpoint of a run folder is evaluated under that run's rollout settings
(turns, context, tokens per turn, prices, default preference) and, in a service started here, its tool
service's config (``tools.service``: the default recipe's one-document search), so its figures are the run's
held-out figures; the other policies under ``max_turns``, ``orchestrator.*`` and ``default_preference``.
Turns: a record's own ``max_turns`` when it has one, else 12; ``max_turns=N`` gives every episode N.
An ``openai:`` policy evaluated beside a ``checkpoint:RUN`` (such as that run's export served by
vLLM's OpenAI-compatible server, docs/checkpoints_and_export.md) runs under the run's turn budget
and tokens per turn, unless ``max_turns=`` or ``openai.max_tokens=`` (else 1024) is given; when the
policies' limits still differ, one printed line says which policy runs under which.
``--help`` lists every key with its default.
"""

import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Optional

from nemo_orchestra.config import ConfigError, load_config, load_structured
from nemo_orchestra.config_help import recipe_help, wants_help
from nemo_orchestra.evaluation.policies import build_policy
from nemo_orchestra.evaluation.report import rows_by_category, summarize, write_report
from nemo_orchestra.evaluation.harness import PolicyRun, run_all
from nemo_orchestra.rollout.loop import LoopLimits
from nemo_orchestra.runtime.console import setup_logging
from tools_env.task import load_jsonl

MAX_TURNS = 12  # an episode's turns when neither max_turns= nor its record gives any
OPENAI_MAX_TOKENS = 1024  # an openai: policy's tokens per turn when neither openai.max_tokens= nor a run gives any

PRESETS = {
    "accuracy": {"accuracy": 1.0, "cost": 0.0, "latency": 0.0},
    "balanced": {"accuracy": 1.0, "cost": 1.0, "latency": 0.5},
    "cost": {"accuracy": 0.5, "cost": 1.0, "latency": 0.0},
}


@dataclass
class ToolsEnvOptions:
    url: Optional[str] = None  # comma-separated replica URLs; none: start a local service
    token: Optional[str] = None
    config: Optional[str] = None  # service config file (yaml/json) for the local service


@dataclass
class OpenAIOptions:
    api_key_env: Optional[str] = None
    temperature: float = 0.0
    max_tokens: Optional[int] = None  # per turn; none: a run's beside a checkpoint:RUN, else 1024
    # sent as chat_template_kwargs; none: a run's model.enable_thinking beside a checkpoint:RUN, else not sent
    enable_thinking: Optional[bool] = None
    timeout_s: float = 120.0


@dataclass
class CheckpointOptions:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0  # sampled turns: mixed into each turn's seed (0: the draws of a run's own held-out report)


@dataclass
class OrchestratorPrices:
    price_in: float = 0.2  # $/1M tokens the policy itself reads and writes (Qwen3-8B in the paper)
    price_out: float = 0.2


@dataclass
class EvalConfig:
    tasks: str = ""
    output: str = ""
    policies: str = "strongest,cheapest,random"
    preferences: str = "record"
    alpha: Optional[float] = None
    samples: int = 1
    limit: int = 0  # 0: every task
    max_turns: Optional[int] = None  # every episode's turns; none: a record's own, else 12
    concurrency: int = 16
    seed: int = 0
    default_preference: Dict[str, float] = field(  # for records without one: the training reward's default
        default_factory=lambda: dict(load_config().reward.default_preference)
    )
    orchestrator: OrchestratorPrices = field(default_factory=OrchestratorPrices)
    tools_env: ToolsEnvOptions = field(default_factory=ToolsEnvOptions)
    openai: OpenAIOptions = field(default_factory=OpenAIOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    progress: bool = True

    def validate(self) -> None:
        if not self.tasks or not self.output:
            raise ValueError("tasks=FILE and output=DIR are required")
        if self.samples < 1 or self.concurrency < 1:
            raise ValueError("samples and concurrency must be >= 1")
        for key, value in (("max_turns", self.max_turns), ("openai.max_tokens", self.openai.max_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{key}: must be >= 1 (or unset)")
        parse_preferences(self.preferences)


def parse_preferences(spec: str) -> dict:
    out = {}
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        if name == "record":
            out[name] = None
        elif name in PRESETS:
            out[name] = PRESETS[name]
        elif name.count("/") == 2:
            acc, cost, lat = (float(x) for x in name.split("/"))
            out[name] = {"accuracy": acc, "cost": cost, "latency": lat}
        else:
            raise ValueError(f"preferences: unknown {name!r}; use record, {', '.join(PRESETS)} or ACC/COST/LAT")
    return out


def service_config(cfg: EvalConfig) -> dict:
    """The local service's config: a ``checkpoint:RUN`` policy's run's (``tools.service`` of its config.yaml: the
    tools' prices and settings its held-out report ran with), a given file over it, then the synthesized
    folder's corpus for `search`. Its ``guards.max_turns``, unless set, is at least the largest turn budget an
    episode gets (``max_turns``, else its record's), so the budget ends an episode and not the service's guard.
    Runs trained with different service configs are refused together: one service cannot be both."""
    import copy

    from nemo_orchestra.evaluation.checkpoint_policy import run_settings
    from tools_env.service_config import GuardConfig

    specs = [s.strip().split(":", 1)[1] for s in cfg.policies.split(",") if s.strip().startswith("checkpoint:")]
    runs = {spec: settings.service for spec in specs if (settings := run_settings(spec)) and settings.service}
    if len({json.dumps(v, sort_keys=True) for v in runs.values()}) > 1:
        raise ValueError(
            f"policies: the runs {', '.join(runs)} were trained with different tool service configs "
            "(tools.service); evaluate them one at a time"
        )
    config: dict = copy.deepcopy(next(iter(runs.values()), {}))
    if cfg.tools_env.config:
        import yaml

        with open(cfg.tools_env.config) as f:
            config = _merged(config, yaml.safe_load(f) or {})
    budgets = [cfg.max_turns] if cfg.max_turns else [r.max_turns or MAX_TURNS for r in load_jsonl(cfg.tasks)]
    guards = config.setdefault("guards", {})
    if isinstance(guards, dict) and "max_turns" not in guards:
        guards["max_turns"] = max(GuardConfig.max_turns, *budgets)
    manifest_path = os.path.join(os.path.dirname(os.path.abspath(cfg.tasks)), "manifest.json")
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            tools = json.load(f).get("service_tools", {})
        base = os.path.dirname(manifest_path)
        for name, section in tools.items():
            section = dict(section)
            if "corpus" in section:
                section["corpus"] = os.path.join(base, section["corpus"])
            config.setdefault("tools", {}).setdefault(name, {}).update(section)
    return config


def _merged(base: dict, over: dict) -> dict:
    """``over`` on ``base``, mapping by mapping."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def policy_runs(cfg: EvalConfig, records: list) -> list:
    """Each policy of ``cfg.policies`` with its loop settings. A checkpoint of a run folder runs under its
    run's (``run_settings``); the others under ``max_turns`` (None: each record's own, else ``MAX_TURNS``),
    the orchestrator's prices and ``default_preference``. An ``openai:`` policy beside such a checkpoint
    takes the (first) run's turn budget and tokens per turn, each unless ``max_turns`` or
    ``openai.max_tokens`` is given. When the policies' limits still differ, one printed line names them."""
    from nemo_orchestra.evaluation.checkpoint_policy import run_settings

    specs = [s.strip() for s in cfg.policies.split(",") if s.strip()]
    settings = {s: run_settings(s.split(":", 1)[1]) for s in specs if s.startswith("checkpoint:")}
    first = next((x for x in settings.values() if x is not None), None)
    limits = LoopLimits(
        max_turns=cfg.max_turns or MAX_TURNS,
        task_turns=cfg.max_turns is None,
        price_in=cfg.orchestrator.price_in,
        price_out=cfg.orchestrator.price_out,
    )
    served, served_tokens = limits, cfg.openai.max_tokens or OPENAI_MAX_TOKENS
    if first is not None and cfg.max_turns is None:
        served = replace(limits, max_turns=first.limits.max_turns, task_turns=first.limits.task_turns)
    if first is not None and cfg.openai.max_tokens is None:
        served_tokens = first.max_new_tokens
    options = {
        "tasks": [r.to_dict() for r in records],
        "seed": cfg.seed,
        "openai": {
            **asdict(cfg.openai),
            "max_tokens": served_tokens,
            "enable_thinking": cfg.openai.enable_thinking
            if cfg.openai.enable_thinking is not None or first is None
            else first.enable_thinking,
        },
        "checkpoint": asdict(cfg.checkpoint),
    }
    runs, turns, tokens = [], [], []
    for spec in specs:
        policy = build_policy(spec, options)
        if settings.get(spec) is not None:
            runs.append(PolicyRun(policy, settings[spec].limits, settings[spec].default_preference))
            tokens.append(settings[spec].max_new_tokens)
        elif spec.startswith("openai:"):
            runs.append(PolicyRun(policy, served, dict(cfg.default_preference)))
            tokens.append(served_tokens)
        else:  # no tokens per turn: a fixed policy; a checkpoint without a run's settings has its own
            runs.append(PolicyRun(policy, limits, dict(cfg.default_preference)))
            tokens.append(getattr(policy, "max_new_tokens", None))
        turns.append(f"max_turns={'record|' if runs[-1].limits.task_turns else ''}{runs[-1].limits.max_turns}")
    if len(set(turns)) > 1 or len(set(tokens) - {None}) > 1:  # a policy that does not generate has no token limit
        groups: dict = {}
        for run, turn, token in zip(runs, turns, tokens):
            groups.setdefault(turn if token is None else f"{turn}, max_tokens={token}", []).append(run.policy.name)
        print(
            "policies run under different limits (record|N: a record's own max_turns, else N): "
            + "; ".join(f"{', '.join(names)}: {limit}" for limit, names in groups.items())
        )
    return runs


async def evaluate(cfg: EvalConfig, urls: list, token: Optional[str]) -> list:
    from tools_env.client import ToolsEnvClient

    records = load_jsonl(cfg.tasks)
    records = records[: cfg.limit] if cfg.limit else records
    runs = policy_runs(cfg, records)
    client = ToolsEnvClient(urls, token=token)
    try:
        return await run_all(
            client,
            runs,
            records,
            parse_preferences(cfg.preferences),
            samples=cfg.samples,
            alpha=cfg.alpha,
            concurrency=cfg.concurrency,
            progress=cfg.progress,
        )
    finally:
        await client.aclose()
        for run in runs:
            await run.policy.aclose()


def print_rows(rows: list) -> None:
    """The report's rows as a table: accuracy, pass^k at the largest k, mean cost, tool latency, wall time."""
    print(
        f"{'policy':<24}{'pref':<12}{'n':>5}{'acc':>8}{'pass^k':>10}{'cost $':>11}{'lat s':>8}{'wall s':>8}"
        f"{'utility':>10}  pareto"
    )
    for r in rows:
        k = max(r.pass_hat_k, key=int, default=None)
        pass_k = f"{r.pass_hat_k[k]:.3f}^{k}" if k is not None else "-"
        print(
            f"{r.policy:<24}{r.preference:<12}{r.n:>5}{r.accuracy:>8.3f}{pass_k:>10}{r.mean_cost:>11.6f}"
            f"{r.mean_latency_s:>8.2f}{r.mean_wall_s:>8.2f}{r.mean_utility:>10.4f}  {'*' if r.pareto else ''}"
        )


def main(argv: list) -> int:
    if wants_help(argv):
        print(recipe_help(__doc__, EvalConfig), end="")
        return 0
    setup_logging("INFO", 0)  # before a checkpoint policy imports Megatron-Core or vLLM
    try:
        cfg = load_structured(EvalConfig, argv)
        for spec in cfg.policies.split(","):  # fail on an unknown or unavailable policy before starting anything
            if not spec.strip().startswith("checkpoint:"):
                openai = {**asdict(cfg.openai), "max_tokens": cfg.openai.max_tokens or OPENAI_MAX_TOKENS}
                build_policy(spec.strip(), {"tasks": [], "openai": openai})
            else:
                from nemo_orchestra.evaluation.checkpoint_policy import resolve_export, run_settings

                resolve_export(spec.strip().split(":", 1)[1])
                run_settings(spec.strip().split(":", 1)[1])
        if not os.path.isfile(cfg.tasks):
            raise ValueError(f"tasks: no such file {cfg.tasks}")
        if not load_jsonl(cfg.tasks):  # a malformed line raises, naming the file, line and field
            raise ValueError(f"tasks: {cfg.tasks} holds no task records")
        service = None if cfg.tools_env.url else service_config(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if cfg.tools_env.url:
        results = asyncio.run(evaluate(cfg, cfg.tools_env.url.split(","), cfg.tools_env.token))
    else:
        from tools_env.supervisor import start_service

        with start_service(service) as svc:
            results = asyncio.run(evaluate(cfg, svc.urls, svc.token))
    rows = summarize(results)
    meta = {
        "tasks": cfg.tasks,
        "n_tasks": len({r.task_id for r in results}),
        "wall_s": time.perf_counter() - t0,
        "title": f"{os.path.basename(cfg.tasks)}: accuracy vs cost",
        "config": asdict(cfg),
        # the simulated user of tau2 tasks, for the tau2 result files; a service not started here: not known
        "tau2_user": None if service is None else service.get("user"),
    }
    paths = write_report(cfg.output, rows, results, meta)
    print_rows(rows)
    categories = rows_by_category(results)
    if len(categories) > 1:
        for category, cat_rows in categories.items():
            print(f"-- {category}")
            print_rows(cat_rows)
    print(f"wrote {', '.join(paths.values())} in {meta['wall_s']:.1f}s")
    return 0


if __name__ == "__main__":
    from nemo_orchestra.runtime.reaper import contain

    contain()  # the tool service and a checkpoint's engine end with the evaluation, SIGKILL included
    sys.exit(main(sys.argv[1:]))
