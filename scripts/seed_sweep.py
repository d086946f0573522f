"""Run the GRPO recipe once per seed and print the per-seed table of its held-out results.

    python scripts/seed_sweep.py --seeds 1 2 3 4 5 [-- key=value ...]
    python scripts/seed_sweep.py --table runs/seeds/seed-1 runs/seeds/seed-2    # table of finished runs
    python scripts/seed_sweep.py --table runs/seeds/seed-* --stages greedy      # from the greedy evaluation
    python scripts/seed_sweep.py --table runs/seeds/seed-* --check claims       # exit 1 if a run misses a claim
    python scripts/seed_sweep.py --seeds 1 2 3 4 5 --check targets              # exit 1 if a run misses a target
    python scripts/seed_sweep.py --seeds 31 32 33 34 35 --check targets --at-least 4   # exit 1 if 2 runs miss

Each run goes to <--root>/seed-<N> (run.resume=false) with the overrides given after ``--``. The
table has, per seed: wall time; held-out accuracy before and after GRPO beside the preference
ceiling, and the share of the gap between them the run closed; cost per correct answer on
cost-sensitive tasks before and after; the preference separation (expert-large's share of expert
calls on accuracy-first tasks minus its share on cost-sensitive ones); and cost-sensitive
arithmetic: accuracy and mean cost, which only the free calculator reaches (an expert call costs
more than $0.0002). "Preference ceiling" is the held-out set's expected accuracy when each task
takes the route its own reward prefers: the calculator (exact) on arithmetic that offers it, the
expert ``PREFERRED`` names on cost-sensitive tasks (``nemo_orchestra/data/default_tasks.py``), the
most accurate simulated expert elsewhere. A policy that follows the preferences can expect no more.

``--check targets`` names each run and each target it misses (``targets()``) and exits 1 when a run misses
one, or with ``--at-least N`` when fewer than N runs meet them all: within ``--minutes`` (10), 80% of the
gap closed, cost per correct answer on cost-sensitive tasks at most half the warm start's, separation of
at least 0.5, cost-sensitive arithmetic at accuracy 0.8 or better for $0.0002 or less a task; on the
multi-step tasks accuracy of at least 0.8, on their cost-sensitive ones at least 0.7 of rollouts taking the
chain (no expert-large call) at a cost per correct answer of at most a third of the warm start's, and
expert-large called on accuracy-first ones in a share of rollouts at least 0.5 above the cost-sensitive
ones'; format errors a turn after GRPO at most the warm start's plus 0.01. The multi-step separation cell
also names the first GRPO step at which it reached 0.5 over the last ``SEPARATION_WINDOW`` steps' rollouts
(``first_separated_step``, from metrics.jsonl).

The figures come from the run's sampled held-out evaluation (``evaluation.samples`` rollouts per
task at the rollout temperature and top-p: the policy GRPO trains, with 8 x the episodes) where the
run has one, else from its greedy one; ``--stages greedy`` picks the greedy one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

from nemo_orchestra.data.default_tasks import CHAIN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = (
    "| seed | time | accuracy | preference ceiling | gap closed | cost per correct, cost-sensitive $ | separation "
    "| arithmetic, cost-sensitive: accuracy, $ per task | multi-step: accuracy | multi-step, cost-sensitive: chain "
    "share, $ per correct | multi-step separation | format errors a turn | meets the targets |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def _large_share(s: dict) -> float:
    return s.get("expert_share/expert-large", 0.0)


def _large_calls(s: dict) -> float:
    """The share of rollouts that call expert-large at least once (0 where none does: the slice has no key)."""
    return s.get("rollout_share/expert-large", 0.0) if s else math.nan


# the expert a cost-sensitive task's reward prefers under the default simulated experts, by category
# (default_tasks.py); arithmetic that offers the calculator takes it under either preference, a
# cost-sensitive multi-step task the chain (two searches and the answer, each written by expert-small)
PREFERRED = {"lookup": "expert-small", "reasoning": "expert-medium", CHAIN: "expert-small"}


def preference_ceiling(run_dir: str) -> float:
    """The held-out set's expected accuracy when every task takes the route its own reward prefers: the
    calculator (exact) on arithmetic that offers it, the expert ``PREFERRED`` names on cost-sensitive
    tasks, the chain on cost-sensitive multi-step tasks (where the search finds both facts its writer's
    accuracy with the evidence, elsewhere its accuracy alone), else
    (or where the run lacks that expert) the most accurate of the run's simulated experts for the task's
    category. NaN without the run's heldout.jsonl and config.yaml, with endpoint experts, or with a
    multi-step task that does not say whether the search finds its facts (``meta.searchable``)."""
    tasks_path, config_path = os.path.join(run_dir, "heldout.jsonl"), os.path.join(run_dir, "config.yaml")
    if not (os.path.exists(tasks_path) and os.path.exists(config_path)):
        return math.nan
    import yaml

    from tools_env.service_config import ServiceConfig, for_category
    from tools_env.task import load_jsonl

    with open(config_path) as f:
        service = ((yaml.safe_load(f) or {}).get("tools") or {}).get("service") or {}
    experts = ServiceConfig.from_dict(service).experts.simulated
    if not experts:  # endpoint experts: their accuracy is not known in advance
        return math.nan
    tasks = load_jsonl(tasks_path)
    exact = [t.category == "arithmetic" and "calculator" in t.tools for t in tasks]

    def expected(t, calculator: bool) -> float:
        if calculator:
            return 1.0
        alias = PREFERRED.get(t.category) if t.meta.get("preference_name") == "cost_sensitive" else None
        if t.category == CHAIN and alias:
            # a record that does not say whether the search finds both facts: unknown
            if t.meta.get("searchable") is None:
                return math.nan
            e = experts[alias]
            if t.meta["searchable"]:
                return max(for_category(e.evidence_accuracy, t.category), for_category(e.accuracy, t.category))
            return for_category(e.accuracy, t.category)
        if alias in experts:
            return for_category(experts[alias].accuracy, t.category)
        return max(for_category(e.accuracy, t.category) for e in experts.values())

    ceiling = [expected(t, x) for t, x in zip(tasks, exact)]
    return sum(ceiling) / len(ceiling) if ceiling else math.nan


def pick_stages(evals: dict, stages: str = "sampled") -> tuple[dict, dict]:
    """The first and last held-out evaluation of ``stages``: "sampled" (the stages named "step N, K
    samples", or the greedy ones where the run has none) or "greedy" (the stages named "step N")."""
    sampled = [k for k in evals if k.endswith(" samples")]
    if stages not in ("sampled", "greedy"):
        raise ValueError(f"stages must be sampled or greedy, not {stages!r}")
    names = sampled if stages == "sampled" and sampled else [k for k in evals if k not in sampled]
    if not names:
        raise ValueError(f"no {stages} held-out evaluation among {list(evals)}")
    return evals[names[0]], evals[names[-1]]


def summary(run_dir: str, stages: str = "sampled") -> dict:
    """The figures of one finished run, from its eval.json (first and last held-out evaluation)."""
    path = os.path.join(run_dir, "eval.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir}: no eval.json (the run did not finish its evaluation)")
    with open(path) as f:
        evals = json.load(f)
    before, after = pick_stages(evals, stages)
    arith = after.get("category/arithmetic/cost_sensitive", {})
    cheap = "preference/cost_sensitive"
    out = {
        "acc": (before["all"]["accuracy"], after["all"]["accuracy"]),
        "cpc": (before["all"]["cost_per_correct"], after["all"]["cost_per_correct"]),
        "cpc_cost_sensitive": (
            before.get(cheap, {}).get("cost_per_correct", math.nan),
            after.get(cheap, {}).get("cost_per_correct", math.nan),
        ),
        "separation": _large_share(after.get("preference/accuracy_first", {}))
        - _large_share(after.get("preference/cost_sensitive", {})),
        "calc": (arith.get("accuracy", math.nan), arith.get("cost_mean", math.nan)),
        "ceiling": preference_ceiling(run_dir),
        "has_chain": f"category/{CHAIN}" in after,
        "multistep_acc": after.get(f"category/{CHAIN}", {}).get("accuracy", math.nan),
        "chain_share": 1.0 - _large_calls(after.get(f"category/{CHAIN}/cost_sensitive")),
        "cpc_chain": (
            before.get(f"category/{CHAIN}/cost_sensitive", {}).get("cost_per_correct", math.nan),
            after.get(f"category/{CHAIN}/cost_sensitive", {}).get("cost_per_correct", math.nan),
        ),
        "multistep_separation": _large_calls(after.get(f"category/{CHAIN}/accuracy_first"))
        - _large_calls(after.get(f"category/{CHAIN}/cost_sensitive")),
        "separation_step": first_separated_step(run_dir),
        "format_errors": (
            before["all"].get("format_error_rate", math.nan),
            after["all"].get("format_error_rate", math.nan),
        ),
    }
    timing = os.path.join(run_dir, "wall_time_s")
    if os.path.exists(timing):
        with open(timing) as f:
            out["time_s"] = float(f.read())
    else:
        out["time_s"] = math.nan
    return out


SEPARATION_WINDOW = 10  # steps: a step's 8 prompts hold one or two multi-step tasks of each preference


def first_separated_step(run_dir: str, threshold: float = 0.5, window: int = SEPARATION_WINDOW) -> float:
    """The first GRPO step at which, over the last ``window`` steps, the share of rollouts calling expert-large
    on multi-step accuracy-first tasks exceeds that on cost-sensitive ones by ``threshold``
    (``rollout/large_rollouts/<category>/<profile>``, averaged over the steps that had such tasks, at least three
    of each); inf when it never does, NaN when the run has no metrics.jsonl."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return math.nan
    keys = [f"rollout/large_rollouts/{CHAIN}/{p}" for p in ("accuracy_first", "cost_sensitive")]
    seen: list[tuple[int, dict]] = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "step" in r and any(k in r for k in keys):
                seen.append((int(r["step"]), {k: r[k] for k in keys if k in r}))
    for i, (step, _) in enumerate(seen):
        recent = [v for st, v in seen[: i + 1] if st > step - window]
        shares = [[v[k] for v in recent if k in v] for k in keys]
        if (
            min(map(len, shares)) >= 3
            and sum(shares[0]) / len(shares[0]) - sum(shares[1]) / len(shares[1]) >= threshold
        ):
            return float(step)
    return math.inf


def gap_closed(s: dict) -> float:
    """The share of the gap between the warm start's accuracy and the preference ceiling that the run
    closed (NaN without a ceiling, or with a warm start already at it)."""
    (a0, a1), ceiling = s["acc"], s["ceiling"]
    return (a1 - a0) / (ceiling - a0) if ceiling - a0 > 1e-9 else math.nan


GAP_TARGET = "80% of the gap to the preference ceiling closed"


def targets(minutes: float = 10.0) -> dict:
    """The default run's targets (docs/data_and_evaluation.md), each judged on a run against its own warm
    start; a NaN figure (a slice the evaluation lacks) misses."""
    return {
        f"within {minutes:g} minutes": lambda s: not s["time_s"] > 60.0 * minutes,  # unknown (nan): not judged
        GAP_TARGET: lambda s: gap_closed(s) >= 0.8 or s["acc"][1] >= s["ceiling"],
        "cost per correct answer on cost-sensitive tasks at most half the warm start's": lambda s: (
            s["cpc_cost_sensitive"][1] <= 0.5 * s["cpc_cost_sensitive"][0]
        ),
        "separation of at least 0.5": lambda s: s["separation"] >= 0.5,
        "cost-sensitive arithmetic at 0.8 or better for $0.0002 or less": lambda s: (
            s["calc"][0] >= 0.8 and s["calc"][1] <= 2e-4
        ),
        "multi-step accuracy at least 0.8": lambda s: s["multistep_acc"] >= 0.8,
        "cost-sensitive multi-step: at least 0.7 of rollouts take the chain, cost per correct answer at most a "
        "third of the warm start's": lambda s: s["chain_share"] >= 0.7 and s["cpc_chain"][1] <= s["cpc_chain"][0] / 3,
        "multi-step separation of at least 0.5": lambda s: s["multistep_separation"] >= 0.5,
        "format errors a turn at most the warm start's plus 0.01": lambda s: (
            s["format_errors"][1] <= s["format_errors"][0] + 0.01
        ),
    }


CHAIN_TARGETS = ("multi-step accuracy", "cost-sensitive multi-step", "multi-step separation")


def missed_targets(s: dict, minutes: float = 10.0) -> list[str]:
    """The targets ``s`` misses, by name (the multi-step ones where the run's held-out set has multi-step
    tasks); the gap's says so when no ceiling is known."""
    judged = {n: h for n, h in targets(minutes).items() if s["has_chain"] or not n.startswith(CHAIN_TARGETS)}
    missed = [name for name, holds in judged.items() if not holds(s)]
    unknown = (
        f"{GAP_TARGET} (no preference ceiling: the run lacks heldout.jsonl or config.yaml, its experts are "
        "endpoints, or a multi-step task lacks meta.searchable)"
    )
    return [unknown if name == GAP_TARGET and math.isnan(s["ceiling"]) else name for name in missed]


def meets(s: dict, minutes: float = 10.0) -> bool:
    return not missed_targets(s, minutes)


# What the docs say the default run learns (docs/data_and_evaluation.md), on every seed, judged on the sampled held-out evaluation
# (the policy GRPO trains) against the run's own warm start. A run that misses one is a regression.
CLAIMS = {
    "held-out accuracy rises": lambda s: s["acc"][1] > s["acc"][0],
    "preferences apart in the right direction (separation > 0)": lambda s: s["separation"] > 0,
    "within 10 minutes": lambda s: not s["time_s"] > 600,  # unknown (nan): not judged
}


def missed_claims(s: dict) -> list[str]:
    return [name for name, holds in CLAIMS.items() if not holds(s)]


def check(runs: list[tuple[str, str]], which: str, stages: str = "sampled", minutes: float = 10.0) -> list[str]:
    """One line per run that misses ``which`` (``claims``: CLAIMS; ``targets``: ``targets(minutes)``),
    naming what it misses."""
    out = []
    for seed, d in runs:
        s = summary(d, stages)
        missed = missed_claims(s) if which == "claims" else missed_targets(s, minutes)
        if missed:
            out.append(f"seed {seed} ({d}): misses {'; '.join(missed)}")
    return out


def row(seed: str, s: dict, minutes: float = 10.0) -> str:
    (a0, a1), (c0, c1), (ca, cc) = s["acc"], s["cpc_cost_sensitive"], s["calc"]
    t = s["time_s"]
    wall = "?" if math.isnan(t) else f"{int(t // 60)} min {int(t % 60):02d} s"
    gap, ceiling = gap_closed(s), s["ceiling"]
    ceiling_text = "?" if math.isnan(ceiling) else f"{ceiling:.3f}"
    gap_text = "?" if math.isnan(ceiling) else "none to close" if math.isnan(gap) else f"{gap:.2f}"
    (m0, m1), (f0, f1) = s["cpc_chain"], s["format_errors"]
    at = s.get("separation_step", math.nan)
    chain = (
        f"{s['multistep_acc']:.3f} | {s['chain_share']:.2f}, {m0:.6f} -> {m1:.6f} | {s['multistep_separation']:+.2f}"
        f" ({'step ?' if math.isnan(at) else 'never 0.5' if math.isinf(at) else f'0.5 at step {int(at)}'})"
        if s["has_chain"]
        else "- | - | -"  # no multi-step tasks in the run
    )
    return (
        f"| {seed} | {wall} | {a0:.3f} -> {a1:.3f} | {ceiling_text} | {gap_text} | {c0:.6f} -> {c1:.6f} "
        f"| {s['separation']:+.2f} "
        f"| {ca:.2f}, {cc:.6f} | {chain} | {f0:.3f} -> {f1:.3f} | {'yes' if meets(s, minutes) else 'no'} |"
    )


def table(runs: list[tuple[str, str]], stages: str = "sampled", minutes: float = 10.0) -> str:
    return "\n".join([COLUMNS] + [row(seed, summary(d, stages), minutes) for seed, d in runs])


def main(argv: list[str]) -> int:
    own, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", nargs="*", default=[])
    p.add_argument("--root", default="runs/seeds")
    p.add_argument("--table", nargs="*", default=None, metavar="RUN_DIR")
    p.add_argument("--stages", choices=("sampled", "greedy"), default="sampled")
    p.add_argument(
        "--check",
        choices=("claims", "targets"),
        default=None,
        help="exit 1 when a run misses the claims of docs/data_and_evaluation.md (CLAIMS) or the targets (targets())",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="the time limit a run is judged by (10: the README's machine; 15: an AVX2-only one)",
    )
    p.add_argument(
        "--at-least",
        type=int,
        default=None,
        metavar="N",
        help="with --check: exit 0 when at least N runs meet it (the targets ask 4 of 5 seeds); default: every run",
    )
    args = p.parse_args(own)
    n_runs = len(args.table) if args.table is not None else len(args.seeds)
    if args.at_least is not None and not 1 <= args.at_least <= max(n_runs, 1):
        p.error(f"--at-least must be from 1 to the number of runs ({n_runs}), not {args.at_least}")
    if args.table is not None:
        runs = [(os.path.basename(d.rstrip("/")), d) for d in args.table]
        try:
            print(table(runs, args.stages, args.minutes))
            return _judge(runs, args)
        except (FileNotFoundError, KeyError, ValueError) as e:
            print(f"seed_sweep: {e}", file=sys.stderr)
            return 2
    if not args.seeds:
        p.error("give --seeds or --table")
    runs = []
    for seed in args.seeds:
        out = os.path.join(args.root, f"seed-{seed}")
        cmd = [sys.executable, os.path.join(ROOT, "recipes", "grpo_orchestrator.py"), f"run.seed={seed}"]
        cmd += [f"run.output_dir={out}", "run.resume=false", *overrides]
        print(f"seed {seed}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call(cmd)
        if rc != 0:
            print(f"seed {seed}: the run exited with {rc}; see {out}", file=sys.stderr)
            return rc
        with open(os.path.join(out, "wall_time_s"), "w") as f:
            f.write(f"{time.monotonic() - t0:.1f}\n")
        runs.append((seed, out))
    print(table(runs, args.stages, args.minutes))
    return _judge(runs, args)


def _judge(runs: list[tuple[str, str]], args) -> int:
    if args.check is None:
        return 0
    misses = check(runs, args.check, args.stages, args.minutes)
    for line in misses:
        print(line, file=sys.stderr)
    met = len(runs) - len(misses)
    need = len(runs) if args.at_least is None else args.at_least
    print(f"{met} of {len(runs)} run(s) meet the {args.check}" + ("" if args.at_least is None else f" ({need} needed)"))
    return 0 if met >= need else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
