"""TP=2, PP=2 and DP=2 on 2 gloo ranks give what one rank gives, within fp32 rounding.

One 2-rank job (``scenarios.spawn``) runs every scenario against a single-rank reference on the
same weights and documents; each test checks one scenario's figures.
"""

import pytest

from tests.integration.distributed import scenarios

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

LOGPROB_TOL = 2e-5  # fp32 rounding of a 256-entry log-softmax, summed in another order
GRAD_TOL = 2e-6  # about 1e-6 relative to the largest gradient entry (~1.7)
SHARED_GRAD_REL_TOL = 3e-6  # relative to the largest gradient entry: 25 fp32 ulps


@pytest.fixture(scope="module")
def results():
    return scenarios.spawn()


def _ok(results, name):
    r = results[name]
    assert "error" not in r, r.get("error")
    return r


def _matches_one_rank(r, grad_tol):
    assert r["logprobs"] < LOGPROB_TOL, r
    assert r["reference_logprobs"] < LOGPROB_TOL, r
    assert r["metrics"] < 1e-5 and r["entropy"] < 1e-5, r
    assert r["grads"] < grad_tol, r


@pytest.mark.parametrize("name", ["tp", "pp", "dp"])
def test_layout_matches_one_rank(results, name):
    _matches_one_rank(_ok(results, name), GRAD_TOL)


def test_plans_restatement_at_tp2_matches_one_rank(results):
    """The restatement term's log-probability of a set of tokens, read from vocabulary-parallel logits at TP=2,
    gives one rank's loss and gradients; the term moves them well beyond the tolerance."""
    r = _ok(results, "restatement")
    _matches_one_rank(r, GRAD_TOL)
    assert r["plans"] >= 12 and r["term"] > 100 * GRAD_TOL, r


def test_tp_gathers_exact_weights_and_offloaded_reference(results):
    r = _ok(results, "tp")
    assert r["gather"] == 0.0  # shards concatenated back bit for bit (fc1 un-interleaved)


def test_pp_packs_have_one_length_and_gather_exact_weights(results):
    r = _ok(results, "pp")
    assert r["pack_lengths"] == [64]  # every pack padded to parallel.microbatch_tokens
    assert r["gather"] == 0.0


def test_dp_distributed_optimizer_step_matches_adam_on_the_whole_batch(results):
    r = _ok(results, "dp")
    assert r["dist_opt_grad_norm"] < 1e-5, r
    assert r["dist_opt_params"] < 1e-6, r


def test_packed_equals_per_document(results):
    r = _ok(results, "packed")
    assert r["packs"][0] < r["packs"][1]
    assert r["metrics"] < 1e-5 and r["grads"] < GRAD_TOL, r


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_shared_prompts_match_whole_trajectories_on_one_rank(results, layout):
    """TP=2 and PP=2: a group's prompt packed once gives the logprobs, loss and gradients of every
    trajectory packed whole on one rank."""
    r = _ok(results, "shared")[layout]
    assert r["shared_prompts"] >= 2, r  # the path under test ran
    assert r["logprobs"] < LOGPROB_TOL and r["reference_logprobs"] < LOGPROB_TOL, r
    assert r["metrics"] < 1e-5 and r["entropy"] < 1e-5, r
    # fp32 rounding: the prompt's attention runs in other query blocks than inside the whole trajectory
    # (nemo_orchestra/kernels/cpu_attention.py), and its keys' gradients sum over the continuations in another order
    assert r["grads"] < SHARED_GRAD_REL_TOL * r["grad_scale"], r


def test_per_turn_credit_reaches_the_reference_and_changes_its_gradients(results):
    """``advantage.credit=turn`` on multi-turn groups: every rollout's turns get advantages of their own,
    the single-rank reference trains each target on its turn's, and its gradients are far from those of
    the same rollouts under the episode's advantage, so the layouts' checks below tell the two apart."""
    r = _ok(results, "turn")
    assert r["kept"] == 6 and r["turn_credited_share"] == 1.0, r
    assert r["min_spread"] > 0.05, r  # no rollout's turns share one advantage
    assert r["reference_turn_advantages"] < 1e-6, r  # each target's advantage is its turn's (its start)
    assert r["episode_vs_turn_grads"] > 1000 * GRAD_TOL, r


@pytest.mark.parametrize("layout", ["tp", "pp", "dp"])
def test_per_turn_credit_layout_matches_one_rank(results, layout):
    """TP=2 (with shared prompts), PP=2 and DP=2 train on the per-turn advantages: logprobs, loss metrics
    and gradients of the per-turn single-rank reference."""
    r = _ok(results, "turn")[layout]
    if layout == "tp":
        assert r["shared_prompts"] >= 2, r  # the continuations after a shared prompt carry the turns' advantages
    # with shared prompts, gradients differ by the fp32 rounding test_shared_prompts_match_whole_trajectories
    # describes
    tol = SHARED_GRAD_REL_TOL * r["grad_scale"] if r["shared_prompts"] else GRAD_TOL
    _matches_one_rank(r, tol)


def test_per_turn_credit_per_data_parallel_rank_equals_the_whole_batch(results):
    """Each data-parallel rank draws its own prompts and computes the advantages of its own rollouts
    (train/trainer.py: grpo_step), so a group never spans two ranks: the per-turn and episode advantages
    a rank computes on its groups alone are those computed on every rank's groups together."""
    r = _ok(results, "turn")
    assert r["dp_groups"] == [[0], 3], r  # rank 0 trained on the whole of group 0, and only on it
    assert r["dp_turn_advantages"] < 1e-6 and r["dp_episode_advantages"] < 1e-6, r


def test_checkpoint_saved_at_tp2_resumes_at_dp2(results):
    r = _ok(results, "checkpoint")
    assert r["restored_weights"] == 0.0, r
    assert r["next_step_weights"] < 1e-6 and r["next_step_loss"] < 1e-5, r
    assert r["common_step"] == 1 and r["data_position"] == 1
    assert "nemo_orchestra.json" in r["files"] and "metadata.json" in r["files"]


def test_hf_qwen3_imported_at_tp2_matches_transformers_and_exports_back(results):
    r = _ok(results, "hf_tp2")
    assert r["logprobs_vs_transformers"] < 2e-5, r
    assert r["export_equals_import"] is True
