"""The per-seed table: figures read from a run's eval.json, the targets judged, bad folders refused."""

import json
import math

import pytest

from scripts.seed_sweep import gap_closed, main, meets, missed_targets, summary

EXPERT = {"price_in": 1.0, "price_out": 1.0, "latency_s": {"default": [1, 2]}, "output_tokens": {"default": 10}}


def _slice(acc, cpc, large=None, cost=0.0):
    s = {"accuracy": acc, "cost_per_correct": cpc, "cost_mean": cost}
    if large is not None:
        s["expert_share/expert-large"] = large
    return s


def _run(
    tmp_path,
    name,
    large_acc_first,
    calc_acc,
    seconds,
    acc_after=0.75,
    cheap_cpc_after=0.0005,
    tasks=True,
    multistep=None,
    format_errors=(0.002, 0.011),
):
    """A finished run: warm start at 0.3, a held-out set whose preference ceiling is 0.8 (a cost-sensitive
    lookup on expert-small at 0.8, an accuracy-first one on expert-large at 0.8), cost per correct answer
    on cost-sensitive tasks 0.0012 at the warm start; multi-step tasks at 0.85, their cost-sensitive ones
    with expert-large in 0.2 of rollouts (so 0.8 take the chain) at $0.0009 a correct answer against $0.003
    at the warm start, their accuracy-first ones with expert-large in 0.9 (``multistep`` overrides these)."""
    d = tmp_path / name
    d.mkdir()
    m = {"acc": 0.85, "cheap_large": 0.2, "cpc": (0.003, 0.0009), "first_large": 0.9, **(multistep or {})}
    after = {
        "all": {**_slice(acc_after, 0.0007), "format_error_rate": format_errors[1]},
        "preference/accuracy_first": _slice(0.8, 0.001, large=large_acc_first),
        "preference/cost_sensitive": _slice(0.7, cheap_cpc_after, large=0.1),
        "category/arithmetic/cost_sensitive": _slice(calc_acc, 0.0001, cost=0.00008),
        "category/multistep": _slice(m["acc"], 0.001),
        "category/multistep/cost_sensitive": {
            **_slice(0.8, m["cpc"][1]),
            **({"rollout_share/expert-large": m["cheap_large"]} if m["cheap_large"] else {}),
        },
        "category/multistep/accuracy_first": {**_slice(0.9, 0.006), "rollout_share/expert-large": m["first_large"]},
    }
    before = {
        "all": {**_slice(0.3, 0.0015), "format_error_rate": format_errors[0]},
        "preference/cost_sensitive": _slice(0.3, 0.0012),
        "category/multistep/cost_sensitive": _slice(0.4, m["cpc"][0]),
    }
    (d / "eval.json").write_text(json.dumps({"step 0": before, "step 80": after}))
    (d / "wall_time_s").write_text(f"{seconds}\n")
    if not tasks:
        return str(d)
    tasks = [
        {"category": "lookup", "meta": {"preference_name": "cost_sensitive"}},
        {"category": "lookup", "meta": {"preference_name": "accuracy_first"}},
    ]
    tasks = [{"problem": "q", "answer": "a", "tools": ["expert", "answer"], **t} for t in tasks]
    (d / "heldout.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    simulated = {
        "expert-small": {**EXPERT, "accuracy": {"lookup": 0.8, "default": 0.5}},
        "expert-large": {**EXPERT, "accuracy": {"lookup": 0.8, "default": 0.5}},
    }
    (d / "config.yaml").write_text(json.dumps({"tools": {"service": {"experts": {"simulated": simulated}}}}))
    return str(d)


def test_summary_and_targets(tmp_path):
    s = summary(_run(tmp_path, "a", large_acc_first=0.9, calc_acc=0.86, seconds=512.0))
    assert s["acc"] == (0.3, 0.75) and s["cpc"] == (0.0015, 0.0007) and abs(s["separation"] - 0.8) < 1e-9
    assert s["cpc_cost_sensitive"] == (0.0012, 0.0005) and abs(s["ceiling"] - 0.8) < 1e-9
    assert abs(gap_closed(s) - 0.9) < 1e-9  # (0.75 - 0.3) / (0.8 - 0.3)
    assert s["calc"] == (0.86, 0.00008) and s["time_s"] == 512.0 and meets(s)
    assert not meets(summary(_run(tmp_path, "b", large_acc_first=0.5, calc_acc=0.86, seconds=512.0)))  # 0.4 apart
    assert not meets(summary(_run(tmp_path, "c", large_acc_first=0.9, calc_acc=0.71, seconds=512.0)))
    slow = summary(_run(tmp_path, "d", large_acc_first=0.9, calc_acc=0.86, seconds=601.0))
    assert missed_targets(slow) == ["within 10 minutes"] and meets(slow, minutes=15)
    short = summary(_run(tmp_path, "e", 0.9, 0.86, 500.0, acc_after=0.69))  # 0.78 of the gap
    assert missed_targets(short) == ["80% of the gap to the preference ceiling closed"]
    assert meets(summary(_run(tmp_path, "f", 0.9, 0.86, 500.0, acc_after=0.71)))  # 0.82 of it
    dear = summary(_run(tmp_path, "g", 0.9, 0.86, 500.0, cheap_cpc_after=0.00061))  # more than half of 0.0012
    assert missed_targets(dear) == ["cost per correct answer on cost-sensitive tasks at most half the warm start's"]
    expert_arith = summary(_run(tmp_path, "h", 0.9, 0.86, 500.0))
    expert_arith["calc"] = (0.9, 0.00021)  # accurate, but an expert's price
    assert missed_targets(expert_arith) == ["cost-sensitive arithmetic at 0.8 or better for $0.0002 or less"]


def test_table_of_runs_and_a_clear_error_for_an_unfinished_one(tmp_path, capsys):
    ok = _run(tmp_path, "seed-7", large_acc_first=0.9, calc_acc=0.86, seconds=545.0)
    assert main(["--table", ok]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("| seed-7 | 9 min 05 s | 0.300 -> 0.750 |") and line.endswith("| yes |")
    assert "| 0.850 | 0.80, 0.003000 -> 0.000900 | +0.70 (step ?) | 0.002 -> 0.011 |" in line  # no metrics.jsonl
    (tmp_path / "empty").mkdir()
    assert main(["--table", ok, str(tmp_path / "empty")]) == 2
    assert "no eval.json" in capsys.readouterr().err


def test_the_ceiling_takes_the_calculator_or_the_most_accurate_expert_without_a_preference(tmp_path, capsys):
    d = _run(tmp_path, "seed-9", large_acc_first=0.9, calc_acc=0.86, seconds=500.0)
    tasks = [
        {"category": "arithmetic", "tools": ["calculator", "expert", "answer"]},  # exact: 1.0
        {"category": "arithmetic", "tools": ["expert", "answer"]},  # no calculator: the best expert, 0.8
        {"category": "reasoning", "tools": ["expert", "answer"]},  # 0.6
    ]
    tasks = [{"problem": "q", "answer": "a", **t} for t in tasks]
    (tmp_path / "seed-9" / "heldout.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    expert = {"price_in": 1.0, "price_out": 1.0, "latency_s": {"default": [1, 2]}, "output_tokens": {"default": 10}}
    service = {
        "experts": {
            "simulated": {
                "a": {**expert, "accuracy": {"arithmetic": 0.8, "default": 0.1}},
                "b": {**expert, "accuracy": {"reasoning": 0.6, "default": 0.2}},
            }
        }
    }
    (tmp_path / "seed-9" / "config.yaml").write_text(json.dumps({"tools": {"service": service}}))
    assert abs(summary(d)["ceiling"] - (1.0 + 0.8 + 0.6) / 3) < 1e-9
    no_tasks = _run(tmp_path, "no-tasks", 0.9, 0.86, 500.0, tasks=False)
    assert math.isnan(summary(no_tasks)["ceiling"])
    assert main(["--table", no_tasks]) == 0 and "| ? | ? |" in capsys.readouterr().out  # ceiling, gap: unknown
    assert main(["--table", no_tasks, "--check", "targets"]) == 1
    assert "closed (no preference ceiling: the run lacks heldout.jsonl" in capsys.readouterr().err
    endpoints = {
        "experts": {
            "simulated": {},
            "endpoints": {"gpt": {"base_url": "http://h/v1", "model": "gpt", "price_in": 1.0, "price_out": 1.0}},
        }
    }
    (tmp_path / "seed-9" / "config.yaml").write_text(json.dumps({"tools": {"service": endpoints}}))
    assert math.isnan(summary(d)["ceiling"])  # real experts: no accuracy known in advance


def test_the_sampled_evaluation_is_judged_where_the_run_has_one(tmp_path):
    d = _run(tmp_path, "seed-3", large_acc_first=0.9, calc_acc=0.86, seconds=500.0)
    evals = json.loads((tmp_path / "seed-3" / "eval.json").read_text())
    sampled_after = {**evals["step 80"], "all": _slice(0.8, 0.0006)}
    evals = {
        "step 0": evals["step 0"],
        "step 0, 8 samples": {"all": _slice(0.45, 0.002)},
        "step 80": evals["step 80"],
        "step 80, 8 samples": sampled_after,
    }
    (tmp_path / "seed-3" / "eval.json").write_text(json.dumps(evals))
    assert summary(d)["acc"] == (0.45, 0.8) and summary(d)["cpc"] == (0.002, 0.0006)
    assert summary(d, "greedy")["acc"] == (0.3, 0.75)
    assert main(["--table", d, "--stages", "greedy"]) == 0
    assert main(["--table", d]) == 0  # and a run without sampled stages falls back to its greedy ones
    assert summary(_run(tmp_path, "greedy-only", 0.9, 0.86, 500.0))["acc"] == (0.3, 0.75)


def test_the_preference_ceiling_puts_cost_sensitive_tasks_on_the_route_their_reward_prefers(tmp_path):
    d = _run(tmp_path, "seed-11", large_acc_first=0.9, calc_acc=0.86, seconds=500.0)
    tasks = [
        {"category": "lookup", "meta": {"preference_name": "cost_sensitive"}},  # expert-small: 0.8
        {"category": "lookup", "meta": {"preference_name": "accuracy_first"}},  # the most accurate: 0.98
        {"category": "arithmetic", "tools": ["calculator"], "meta": {"preference_name": "cost_sensitive"}},  # 1.0
    ]
    tasks = [{"problem": "q", "answer": "a", "tools": ["expert", "answer"], **t} for t in tasks]
    (tmp_path / "seed-11" / "heldout.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    expert = {"price_in": 1.0, "price_out": 1.0, "latency_s": {"default": [1, 2]}, "output_tokens": {"default": 10}}
    simulated = {
        "expert-small": {**expert, "accuracy": {"lookup": 0.8, "default": 0.5}},
        "expert-large": {**expert, "accuracy": {"lookup": 0.98, "default": 0.9}},
    }
    (tmp_path / "seed-11" / "config.yaml").write_text(
        json.dumps({"tools": {"service": {"experts": {"simulated": simulated}}}})
    )
    s = summary(d)
    assert abs(s["ceiling"] - (0.8 + 0.98 + 1.0) / 3) < 1e-9


def test_the_claims_check_exits_nonzero_naming_the_run_and_the_claim_it_misses(tmp_path, capsys):
    good = _run(tmp_path, "seed-1", large_acc_first=0.9, calc_acc=0.5, seconds=400.0)  # misses targets, not claims
    assert main(["--table", good, "--check", "claims"]) == 0
    assert main(["--table", good, "--check", "targets"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"seed seed-1 ({good}): misses cost-sensitive arithmetic at 0.8 or better for $0.0002 or less"]
    backwards = _run(tmp_path, "seed-2", large_acc_first=0.05, calc_acc=0.9, seconds=400.0)  # 0.05 - 0.1 < 0
    slow = _run(tmp_path, "seed-3", large_acc_first=0.9, calc_acc=0.9, seconds=700.0)
    assert main(["--table", good, backwards, slow, "--check", "claims"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "seed-2" in err[0] and "separation > 0" in err[0]
    assert "seed-3" in err[1] and "within 10 minutes" in err[1]


def test_at_least_n_runs_meeting_the_targets_is_enough_and_fewer_is_not(tmp_path, capsys):
    """``--at-least N``: the targets ask every target at 4 of 5 seeds; misses are still named."""
    good = [_run(tmp_path, f"seed-{i}", large_acc_first=0.9, calc_acc=0.9, seconds=400.0) for i in (1, 2)]
    bad = _run(tmp_path, "seed-3", large_acc_first=0.9, calc_acc=0.5, seconds=400.0)
    assert main(["--table", *good, "--check", "targets"]) == 0
    assert main(["--table", *good, bad, "--check", "targets"]) == 1
    capsys.readouterr()
    assert main(["--table", *good, bad, "--check", "targets", "--at-least", "2"]) == 0
    out = capsys.readouterr()
    assert "seed-3" in out.err and "2 of 3 run(s) meet the targets (2 needed)" in out.out
    assert main(["--table", *good, bad, "--check", "targets", "--at-least", "3"]) == 1
    for bad in ("0", "3"):  # 2 runs: at least 0 or 3 of them is a mistake, not a check
        with pytest.raises(SystemExit):
            main(["--table", *good, "--check", "targets", "--at-least", bad])


@pytest.mark.parametrize(
    "multistep, format_errors, missed",
    [
        ({"acc": 0.79}, None, "multi-step accuracy at least 0.8"),
        ({"cheap_large": 0.31}, None, "cost-sensitive multi-step: at least 0.7 of rollouts take the chain"),
        ({"cpc": (0.003, 0.00101)}, None, "cost-sensitive multi-step: at least 0.7 of rollouts take the chain"),
        ({"first_large": 0.69}, None, "multi-step separation of at least 0.5"),  # 0.69 - 0.2 apart
        (None, (0.002, 0.0121), "format errors a turn at most the warm start's plus 0.01"),
    ],
)
def test_the_multi_step_and_format_targets_are_judged(tmp_path, multistep, format_errors, missed):
    kw = {"format_errors": format_errors} if format_errors else {}
    s = summary(_run(tmp_path, "a", 0.9, 0.86, 500.0, multistep=multistep, **kw))
    assert [m for m in missed_targets(s)] and missed_targets(s)[0].startswith(missed) and len(missed_targets(s)) == 1


def test_a_chain_no_rollout_leaves_and_a_run_without_multi_step_tasks(tmp_path, capsys):
    s = summary(_run(tmp_path, "a", 0.9, 0.86, 500.0, multistep={"cheap_large": 0.0}))
    assert s["chain_share"] == 1.0 and abs(s["multistep_separation"] - 0.9) < 1e-9 and meets(s)
    d = _run(tmp_path, "b", 0.9, 0.86, 500.0)
    evals = json.loads((tmp_path / "b" / "eval.json").read_text())
    evals = {k: {n: v for n, v in e.items() if "multistep" not in n} for k, e in evals.items()}
    (tmp_path / "b" / "eval.json").write_text(json.dumps(evals))
    assert missed_targets(summary(d)) == []  # a run without multi-step tasks is not judged on them
    assert main(["--table", d]) == 0 and "| - | - | - | 0.002 -> 0.011 |" in capsys.readouterr().out


def test_the_ceiling_puts_cost_sensitive_multi_step_tasks_on_the_chain(tmp_path):
    d = _run(tmp_path, "seed-5", 0.9, 0.86, 500.0)
    tasks = [
        {"category": "multistep", "meta": {"preference_name": "cost_sensitive", "searchable": True}},  # small: 0.9
        {"category": "multistep", "meta": {"preference_name": "cost_sensitive", "searchable": False}},  # small: 0.1
        {"category": "multistep", "meta": {"preference_name": "accuracy_first", "searchable": True}},  # large: 0.95
    ]
    tasks = [{"problem": "q", "answer": "1", "tools": ["search", "calculator", "expert", "answer"], **t} for t in tasks]
    (tmp_path / "seed-5" / "heldout.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    simulated = {
        "expert-small": {
            **EXPERT,
            "accuracy": {"multistep": 0.1, "default": 0.5},
            "evidence_accuracy": {"multistep": 0.9, "default": 1.0},  # the documents found: the writer's odds
        },
        "expert-large": {**EXPERT, "accuracy": {"multistep": 0.95, "default": 0.5}},
    }
    (tmp_path / "seed-5" / "config.yaml").write_text(
        json.dumps({"tools": {"service": {"experts": {"simulated": simulated}}}})
    )
    assert abs(summary(d)["ceiling"] - (0.9 + 0.1 + 0.95) / 3) < 1e-9
    del simulated["expert-small"]["evidence_accuracy"]  # unset: exact with the documents
    (tmp_path / "seed-5" / "config.yaml").write_text(
        json.dumps({"tools": {"service": {"experts": {"simulated": simulated}}}})
    )
    assert abs(summary(d)["ceiling"] - (1.0 + 0.1 + 0.95) / 3) < 1e-9
    del tasks[0]["meta"]["searchable"]  # a record that does not say whether the chain can find its facts
    (tmp_path / "seed-5" / "heldout.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    assert math.isnan(summary(d)["ceiling"])


def test_the_first_step_of_multi_step_separation_over_a_window_of_steps(tmp_path):
    """The step at which expert-large's share of rollouts on multi-step accuracy-first tasks first exceeds
    the cost-sensitive share by 0.5, each averaged over the last 10 steps that had such tasks (at least three
    of each): a single lucky step does not count, a step without one profile carries the last ones."""
    from scripts.seed_sweep import first_separated_step

    key = "rollout/large_rollouts/multistep/"
    rows = [{"step": 1, key + "accuracy_first": 1.0}]  # one profile only: not judged
    rows += [{"step": 2, key + "accuracy_first": 1.0, key + "cost_sensitive": 0.0}]  # one step of each: not judged
    rows += [{"step": s, key + "accuracy_first": 0.6, key + "cost_sensitive": 0.5} for s in range(3, 12)]
    rows += [{"step": 12, key + "accuracy_first": 1.0, key + "cost_sensitive": 0.0}]  # one step: not enough
    rows += [{"step": s, key + "accuracy_first": 1.0} for s in range(13, 16)]  # steps without the category's
    rows += [{"step": 16, "loss": 0.1}]  # cost-sensitive tasks, then none
    rows += [{"step": s, key + "accuracy_first": 1.0, key + "cost_sensitive": 0.0} for s in range(17, 30)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    step = first_separated_step(str(tmp_path))
    window = [r for r in rows if step - 10 < r["step"] <= step]
    af = [r[key + "accuracy_first"] for r in window if key + "accuracy_first" in r]
    cs = [r[key + "cost_sensitive"] for r in window if key + "cost_sensitive" in r]
    assert sum(af) / len(af) - sum(cs) / len(cs) >= 0.5 and 12 < step < 29
    earlier = [r for r in rows if step - 11 < r["step"] <= step - 1]
    af = [r[key + "accuracy_first"] for r in earlier if key + "accuracy_first" in r]
    cs = [r[key + "cost_sensitive"] for r in earlier if key + "cost_sensitive" in r]
    assert sum(af) / len(af) - sum(cs) / len(cs) < 0.5  # the step before had not
    assert math.isnan(first_separated_step(str(tmp_path / "nowhere")))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:12]))
    assert first_separated_step(str(tmp_path)) == math.inf  # never
