"""The evaluation's tau2 result files are tau2-bench's own: tau2's ``Results.load`` reads them, tau2's metrics
over them give the report's pass^k, and tau2's evaluator re-grades a stored simulation to the reward stored.

Policies run through the harness against a service subprocess (so the grader's record crosses HTTP) with the
replay user: the oracle, one that does nothing (greets and signs off), and one whose turn budget runs out
before the conversation ends (no grader record: a ``max_steps`` simulation with reward 0)."""

import asyncio

import pytest

from tools_env.verify import Outcome

pytest.importorskip("tau2", reason="tau2 tasks need the 'tau2' extra")

from nemo_orchestra.evaluation.harness import PolicyRun, run_all  # noqa: E402
from nemo_orchestra.evaluation.policies import Oracle, Policy  # noqa: E402
from nemo_orchestra.evaluation.report import pass_hat_k, summarize, write_report  # noqa: E402
from nemo_orchestra.prompting.chat import ToolCall  # noqa: E402
from nemo_orchestra.rollout.loop import LoopLimits  # noqa: E402
from tools_env.domains.tau2.episode import environment  # noqa: E402
from tools_env.domains.tau2.importer import read_tasks, to_record  # noqa: E402
from tools_env.domains.tau2.package import require_tau2  # noqa: E402
from tools_env.domains.tau2.tools import service_name  # noqa: E402

TASKS, SAMPLES = 3, 2


def records(domain, split, limit):
    """The first ``limit`` tasks of a split as task records (as recipes/import_tau2.py writes them)."""
    env = environment(domain)
    tools = [service_name(domain, t.name) for t in env.get_tools()]
    return [to_record(t, domain, split, env.get_policy(), tools) for t in read_tasks(domain, split)[:limit]]


class DoNothing(Policy):
    """Greets (the gold first message) and then only signs off (the gold last message)."""

    name = "nothing"

    def decide(self, inp):
        a = inp.task.gold_actions[0 if inp.turn == 0 else -1]
        return ToolCall(a["name"], dict(a["arguments"]))


class Stall(DoNothing):
    """Only greets; run under a budget of 1 turn, its conversation ends ungraded."""

    name = "stall"

    def decide(self, inp):
        a = inp.task.gold_actions[0]
        return ToolCall(a["name"], dict(a["arguments"]))


def test_outcome_to_dict_leaves_out_an_absent_record():
    assert Outcome(True, 1.0, "ok").to_dict() == {"correct": True, "score": 1.0, "reason": "ok"}
    assert Outcome(False, 0.0, "no", record={"id": "x"}).to_dict()["record"] == {"id": "x"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from tools_env.client import ToolsEnvClient
    from tools_env.supervisor import start_service

    recs = records("retail", "test", TASKS)
    runs = [
        PolicyRun(Oracle([r.to_dict() for r in recs]), LoopLimits(max_turns=100, task_turns=False)),
        PolicyRun(DoNothing(), LoopLimits(max_turns=12, task_turns=False)),
        PolicyRun(Stall(), LoopLimits(max_turns=1, task_turns=False)),
    ]

    async def run(urls, token):
        client = ToolsEnvClient(urls, token=token)
        try:
            return await run_all(client, runs, recs, {"record": None}, samples=SAMPLES, progress=False)
        finally:
            await client.aclose()

    with start_service({"user": "replay", "guards": {"max_turns": 200}}, workers=1) as svc:
        results = asyncio.run(run(svc.urls, svc.token))
    out = tmp_path_factory.mktemp("eval")
    rows = summarize(results)
    paths = write_report(str(out), rows, results, {"tau2_user": "replay", "config": {"seed": 0}})
    return results, {r.policy: r for r in rows}, paths


def load(paths, policy):
    sim = require_tau2("tau2.data_model.simulation")
    return sim.Results.load(paths[f"tau2_retail_{policy}_record"])


def test_taus_results_load_reads_one_simulation_per_episode_with_trials_per_task(report):
    results, rows, paths = report
    assert {k for k in paths if k.startswith("tau2_")} == {f"tau2_retail_{p}_record" for p in rows}
    for policy in rows:
        res = load(paths, policy)
        assert len(res.simulations) == TASKS * SAMPLES and len(res.tasks) == TASKS
        task_ids = {t.id for t in res.tasks}
        for t in task_ids:
            assert sorted(s.trial for s in res.simulations if s.task_id == t) == list(range(SAMPLES))
        assert res.info.environment_info.domain_name == "retail" and res.info.num_trials == SAMPLES
        assert res.info.agent_info.implementation == f"nemo-orchestra/{policy}"
        assert res.info.user_info.implementation == "nemo-orchestra/replay"
    stalled = load(paths, "stall").simulations
    assert all(s.termination_reason == "max_steps" and s.reward_info.reward == 0.0 for s in stalled)
    assert all(s.messages == [] for s in stalled)
    stall = sorted((r for r in results if r.policy == "stall"), key=lambda r: (r.task_id, r.sample))
    assert [s.duration for s in stalled] == [r.wall_s for r in stall] and all(r.wall_s > 0 for r in stall)
    oracle = [r for r in results if r.policy == "oracle"]
    assert all(r.record is not None and r.record["reward_info"]["reward"] == 1.0 for r in oracle)
    assert all(r.user_cost == 0.0 and r.user_tokens_in == 0 for r in results)  # the replay user is free
    assert rows["oracle"].mean_user_cost == 0.0


def test_taus_metrics_give_the_reports_pass_hat_k(report):
    metrics = require_tau2("tau2.metrics.agent_metrics")
    results, rows, paths = report
    for policy, row in rows.items():
        got = metrics.compute_metrics(load(paths, policy)).pass_hat_ks
        mine = pass_hat_k([r for r in results if r.policy == policy])
        assert {str(k): v for k, v in got.items()} == pytest.approx(mine) == row.pass_hat_k, policy
    assert rows["oracle"].pass_hat_k == {"1": 1.0, "2": 1.0}
    assert rows["stall"].pass_hat_k == {"1": 0.0, "2": 0.0}


def test_taus_evaluator_regrades_a_stored_simulation_to_its_stored_reward(report):
    ev = require_tau2("tau2.evaluator.evaluator")
    tasks_model = require_tau2("tau2.data_model.tasks")
    _, _, paths = report
    for policy in ("oracle", "nothing"):
        res = load(paths, policy)
        for run in res.simulations[:2]:
            task = next(t for t in res.tasks if t.id == run.task_id)
            basis = task.evaluation_criteria.reward_basis
            if tasks_model.RewardType.NL_ASSERTION in basis:  # graded without a judge, as the service did
                task.evaluation_criteria.reward_basis = [b for b in basis if b != tasks_model.RewardType.NL_ASSERTION]
            again = ev.evaluate_simulation(run, task, ev.EvaluationType.ALL, solo_mode=False, domain="retail")
            assert again.reward == run.reward_info.reward, (policy, run.task_id)
