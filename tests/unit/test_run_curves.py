"""``run_report.plot_curves``: a panel per training curve, the expert choice per preference profile, and the
share of rollouts calling expert-large per task kind, drawn from the run's metrics.jsonl."""

import json

import pytest

from nemo_orchestra.train.run_report import plot_curves

pytest.importorskip("matplotlib")


def _metrics(path, with_kinds: bool):
    rows = []
    for step in range(1, 21):
        row = {
            "step": step,
            "reward/mean": 0.5,
            "reward/outcome": 0.6,
            "rollout/cost_mean": 0.001,
            "rollout/format_error_rate": 0.01 * (step % 3),
            "rollout/expert_share/accuracy_first/expert-large": 0.7,
            "rollout/expert_share/cost_sensitive/expert-small": 0.6,
        }
        if with_kinds and step % 2:  # a kind absent from some steps' rollouts
            row["rollout/large_rollouts/multistep/accuracy_first"] = 0.9
            row["rollout/large_rollouts/multistep/cost_sensitive"] = 0.1
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("with_kinds", [True, False])
def test_curves_show_format_errors_and_expert_large_per_task_kind(tmp_path, monkeypatch, with_kinds):
    from matplotlib.figure import Figure

    drawn = {}
    save = Figure.savefig

    def record(fig, *args, **kwargs):
        drawn["titles"] = [ax.get_title() for ax in fig.axes]
        drawn["lines"] = {ax.get_title(): [line.get_label() for line in ax.get_lines()] for ax in fig.axes}
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    _metrics(tmp_path, with_kinds)
    assert plot_curves(str(tmp_path)) == str(tmp_path / "curves.png") and (tmp_path / "curves.png").stat().st_size
    panels = ["reward", "accuracy (training rollouts)", "cost per rollout ($)", "format errors a turn"]
    profiles = ["expert choice, accuracy_first tasks", "expert choice, cost_sensitive tasks"]
    assert drawn["titles"] == panels + profiles + (["rollouts calling expert-large"] if with_kinds else [])
    if with_kinds:
        assert drawn["lines"]["rollouts calling expert-large"] == [
            "multistep/accuracy_first",
            "multistep/cost_sensitive",
        ]
