"""What each of the 2 gloo ranks runs: one scenario per parallel layout, each compared to a
single-rank reference on the same weights and data.

The reference is a plain TP=1/PP=1 GPTModel (no DDP) run on every trajectory as its own
sequence; its loss is sum(token losses) / tokens, backpropagated to ``.grad``. Each scenario
re-initializes Megatron's parallel state in the same 2-process world, builds the policy the
trainer uses (DDP, optimizer), loads the reference's weights into its shards, and reports the
largest differences, gathered back to full tensors. Rank 0 writes them to ``results.json``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import traceback

import torch
import torch.distributed as dist

from tests.helpers import TINY_MODEL

VOCAB = 256
SEED = 0
TINY = [
    *TINY_MODEL,
    "model.tie_embeddings=true",
    "optim.lr=1e-3",
    "optim.grad_clip=1.0",
    "optim.weight_decay=0.0",
    "loss.kl_coef=0.1",
    "parallel.microbatch_tokens=64",
]


# ---- set-up ------------------------------------------------------------------------------------------
def config(tp=1, pp=1, dist_opt=True, *extra):
    from nemo_orchestra.config import load_config

    return load_config(
        [
            *TINY,
            f"parallel.tp={tp}",
            f"parallel.pp={pp}",
            f"parallel.distributed_optimizer={str(dist_opt).lower()}",
            *extra,
        ]
    )


def layout(tp: int, pp: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)


def trajectories(n=6, seed=1):
    """Documents of mixed lengths with random masks, advantages and old/reference logprobs."""
    from tests.helpers import traj

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 30, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        mask = [0] * 3 + (torch.rand(length - 3, generator=g) < 0.7).long().tolist()
        t = traj(ids=ids, mask=mask)
        t.advantage = float(torch.randn(1, generator=g))
        t.meta = {"old": -4 * torch.rand(length, generator=g), "ref": -4 * torch.rand(length, generator=g)}
        out.append(t)
    return out


def grouped_trajectories(seed=2):
    """Two prompts of 20 tokens with three rollouts each (a GRPO group: the prompt packs once with
    ``perf.share_prompts``), random masks after the first generated token, advantages and logprobs."""
    from tests.helpers import traj

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        prompt = torch.randint(1, VOCAB, (20,), generator=g).tolist()
        for _ in range(3):
            n = int(torch.randint(4, 11, (1,), generator=g))
            ids = prompt + torch.randint(1, VOCAB, (n,), generator=g).tolist()
            mask = [0] * 20 + [1] + (torch.rand(n - 1, generator=g) < 0.7).long().tolist()
            t = traj(ids=ids, mask=mask)
            t.advantage = float(torch.randn(1, generator=g))
            t.meta = {"old": -4 * torch.rand(20 + n, generator=g), "ref": -4 * torch.rand(20 + n, generator=g)}
            out.append(t)
    return out


# Per-turn credit: each group's rollouts as their turns' actions (turn keys) and whether they ended correct.
# A later turn is baselined on the rollouts that took the same first action (or, where none did, on the
# others' futures spliced after its own first turn), the first on all the others: each rollout's turns get
# advantages that differ from one another.
TURN_GROUPS = (
    ((("expert:s", "answer"), True), (("expert:s", "expert:l", "answer"), False), (("expert:l", "answer"), True)),
    ((("search", "answer"), False), (("search", "expert:s", "answer"), True), (("expert:l", "answer"), True)),
)
CALL_COST = {"expert:s": 0.01, "expert:l": 0.05, "search": 0.002, "answer": 0.0}


def turn_group(k: int, group: int, seed=4):
    """Group ``k`` of ``TURN_GROUPS`` as the agent loop records it (``group``: its index on the rank that
    made it): a 20-token prompt, then per turn generated tokens (in the loss) and, before the answer, the
    call's observation (not); each turn's key, first generated token, cost and calls; old/reference
    logprobs. Rewards and advantages are not set. The same ``k`` gives the same rollouts on every rank."""
    from nemo_orchestra.types import TurnRecord
    from tests.helpers import traj

    g = torch.Generator().manual_seed(seed + k)
    prompt = torch.randint(1, VOCAB, (20,), generator=g).tolist()
    out = []
    for keys, correct in TURN_GROUPS[k]:
        t = traj(correct=correct, group=group, ids=prompt, mask=[0] * 20)
        for key in keys:
            n = int(torch.randint(3, 7, (1,), generator=g))
            start = len(t.token_ids)
            t.token_ids += torch.randint(1, VOCAB, (n,), generator=g).tolist()
            t.loss_mask += [1] * n
            calls = 0 if key == "answer" else 1
            # its cost: the call's price and the turn's own tokens
            t.turns.append(TurnRecord(key=key, start=start, cost=CALL_COST[key] + 1e-4 * n, calls=calls))
            if calls:
                t.call_latencies_s.append(0.5 + float(torch.rand(1, generator=g)))
                obs = int(torch.randint(2, 6, (1,), generator=g))
                t.token_ids += torch.randint(1, VOCAB, (obs,), generator=g).tolist()
                t.loss_mask += [0] * obs
        t.gen_logprobs = [0.0] * len(t.token_ids)
        t.stop_reason = "answer"
        t.tool_cost, t.latency_s = sum(r.cost for r in t.turns), sum(t.call_latencies_s)
        # old/reference logprobs near the tiny model's own (about log 1/256): ratios near 1, so no clip
        # zeroes a token's term and every turn's advantage reaches the gradient
        n = len(t.token_ids)
        t.meta = {k: -math.log(VOCAB) + 0.1 * torch.randn(n, generator=g) for k in ("old", "ref")}
        out.append(t)
    return out


def credit_turns(trajs):
    """Rewards, then ``assign_advantages`` with ``advantage.credit=turn`` (spliced baselines under the
    run's reward), as the trainer runs them on a rank's rollouts; the kept rollouts and the metrics."""
    from nemo_orchestra.config import load_config
    from nemo_orchestra.grpo.advantages import assign_advantages
    from nemo_orchestra.grpo.reward import assign_rewards

    cfg = load_config([*TINY, "advantage.credit=turn"])
    assign_rewards(trajs, cfg.reward)
    return assign_advantages(trajs, cfg.advantage, "cpu", cfg.reward)


def sequences(b):
    """(document index, start, end, prompt) of each sequence of a pack (index < 0: padding or a shared
    prompt; prompt: the (start, end) of the shared prompt the sequence continues, or None)."""
    cu = b.cu_seqlens_B1.tolist()
    prefix = b.prefix_B or [-1] * (len(cu) - 1)
    return [
        (j, s, e, (cu[p], cu[p + 1]) if p >= 0 else None) for j, s, e, p in zip(b.traj_index_B, cu[:-1], cu[1:], prefix)
    ]


def with_logprobs(batches, trajs, index):
    """Old/reference logprobs from the documents (what fill_logprobs would write); pack-local
    document indices become indices into the full list (``index``)."""
    for b in batches:
        b.old_logprobs_T, b.ref_logprobs_T = torch.zeros(b.num_tokens), torch.zeros(b.num_tokens)
        for j, s, e, prompt in sequences(b):
            if j >= 0:
                skip = prompt[1] - prompt[0] if prompt else 0
                b.old_logprobs_T[s:e], b.ref_logprobs_T[s:e] = trajs[j].meta["old"][skip:], trajs[j].meta["ref"][skip:]
        b.traj_index_B = [index[j] if j >= 0 else j for j in b.traj_index_B]
    return batches


def per_document(trajs, multiple=1):
    from nemo_orchestra.train.packing import pack

    return [with_logprobs(pack([t], 10_000, pad_to_multiple=multiple), [t], [i])[0] for i, t in enumerate(trajs)]


def packed(trajs, parallel, index=None, share_prompts=False):
    from nemo_orchestra.train.step import pack_for_step

    return with_logprobs(pack_for_step(trajs, parallel, share_prompts), trajs, index or list(range(len(trajs))))


def full_weights():
    """Random full (TP=1) weights; norms perturbed so their layout is exercised."""
    from nemo_orchestra.megatron.model import build_gpt_model
    from nemo_orchestra.megatron.sharding import model_state

    layout(1, 1)
    cfg = config()
    gpt = build_gpt_model(cfg.model, cfg.parallel, VOCAB, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return {k: v.detach().clone() for k, v in model_state(gpt).items()}


def reference(full, trajs, loss_cfg, plan_coef: float = 0.0):
    """Per-document loss, metrics, logprobs, entropy and gradients on one plain TP=1 model (with ``plan_coef``,
    the documents' plans' restatement too)."""
    from nemo_orchestra.megatron.forward import packed_forward
    from nemo_orchestra.megatron.model import build_gpt_model
    from nemo_orchestra.megatron.sharding import load_local_state
    from nemo_orchestra.megatron.vocab_parallel import logprobs_and_entropy
    from nemo_orchestra.train.step import grpo_loss_fn, restatement_logprobs

    layout(1, 1)
    cfg = config()
    gpt = build_gpt_model(cfg.model, cfg.parallel, VOCAB, torch.device("cpu"), initialize=False)
    load_local_state(gpt, full)
    docs = per_document(trajs)
    total, n, lps, ents, sums = 0.0, 0.0, [], [], {}
    for t, b in zip(trajs, docs):
        logits = packed_forward(gpt, b, torch.device("cpu"))
        lp, ent = logprobs_and_entropy(logits[0], b.target_ids_T, 1.0)
        loss_sum, k, metrics = grpo_loss_fn(loss_cfg)(lp, b)
        if plan_coef and b.plan_rows_P is not None:
            loss_sum = loss_sum - plan_coef * restatement_logprobs(logits, b, None, 1.0).sum()
        total, n = total + loss_sum, n + float(k)
        lps.append(lp.detach())
        ents.append(ent.detach())
        mask = b.loss_mask_T
        metrics["train/entropy"] = (ent * mask).sum() / mask.sum().clamp_min(1.0)
        for key, v in metrics.items():
            if key != "loss/tokens":
                sums[key] = sums.get(key, 0.0) + float(v) * float(k)
    (total / n).backward()
    grads = {name: p.grad.detach().clone() for name, p in gpt.named_parameters()}
    return dict(
        loss=float(total / n), metrics={k: v / n for k, v in sums.items()}, lps=lps, ents=ents, grads=grads, docs=docs
    )


def load_into(policy, full):
    from nemo_orchestra.megatron.sharding import load_full_state

    load_full_state(policy.module, full.__getitem__, list(full))
    load_full_state(policy.reference, full.__getitem__, list(full))


def full_grads(policy):
    from nemo_orchestra.megatron.sharding import canonical_name, gather_full

    gpt = policy.module
    local = {canonical_name(n): p.main_grad for n, p in gpt.named_parameters()}
    return gather_full(local, gpt.config.num_layers, gpt.share_embeddings_and_output_weights, torch.device("cpu"))


def snapshot(gpt) -> dict:
    from nemo_orchestra.megatron.sharding import gather_full_state

    return {k: v.clone() for k, v in gather_full_state(gpt).items()}


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:5]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def doc_values(batches, values) -> dict[int, torch.Tensor]:
    """{document index: its values} of per-pack tensors (a shared prompt's in front of its continuations)."""
    out = {}
    for b, v in zip(batches, values):
        for j, s, e, prompt in sequences(b):
            if j >= 0:
                out[j] = torch.cat([v[prompt[0] : prompt[1]], v[s:e]]) if prompt else v[s:e]
    return out


def compare_lps(ref_lps, ours: dict) -> float:
    """Max |difference| over each document's target positions (its last token has no target)."""
    return max(float((got[:-1] - ref_lps[i][:-1]).abs().max()) for i, got in ours.items())


# ---- scenarios -----------------------------------------------------------------------------------------
def run_parallel(
    tp, pp, full, trajs, ref, share=None, dist_opt=True, offload=False, extra=(), share_prompts=False, plan_coef=0.0
):
    """Loss, metrics, grads and logprobs of the trainer's policy under a layout."""
    from nemo_orchestra.megatron.forward import forward_logprobs
    from nemo_orchestra.train.learner import build_learner
    from nemo_orchestra.train.step import (
        forward_backward,
        grpo_loss_fn,
        reduce_metrics,
        reference_logprobs,
    )

    layout(tp, pp)
    cfg = config(tp, pp, dist_opt, f"reference.offload={str(offload).lower()}", *extra)
    policy = build_learner(cfg, VOCAB, torch.device("cpu"))
    load_into(policy, full)
    mine = share if share is not None else list(range(len(trajs)))
    batches = packed([trajs[i] for i in mine], cfg.parallel, mine, share_prompts)
    for b in batches:
        b.plan_coef = plan_coef
    lps = forward_logprobs(policy.model, batches, torch.device("cpu"))
    ref_lps = reference_logprobs(policy, batches)
    losses = forward_backward(policy, batches, grpo_loss_fn(cfg.loss))
    metrics = reduce_metrics(losses)
    out = {
        "logprobs": compare_lps(ref["lps"], doc_values(batches, lps)),
        # the reference's logprobs exist on the loss's tokens only (0 elsewhere)
        "reference_logprobs": compare_lps(
            [lp * d.loss_mask_T for lp, d in zip(ref["lps"], ref["docs"])], doc_values(batches, ref_lps)
        ),
        "metrics": max(abs(metrics[k] - ref["metrics"][k]) for k in ref["metrics"]),
        "grads": max_diff(full_grads(policy), ref["grads"]),
        "grad_scale": max(float(g.abs().max()) for g in ref["grads"].values()),
        "entropy": abs(metrics["train/entropy"] - ref["metrics"]["train/entropy"]),
        "pack_lengths": sorted({b.num_tokens for b in batches}),
        "shared_prompts": sum(j == -2 for b in batches for j in b.traj_index_B),
    }
    return out, policy, cfg


def scenario_tp(full, trajs, ref):
    from nemo_orchestra.export.qwen3 import full_state_dict

    out, policy, _ = run_parallel(2, 1, full, trajs, ref, offload=True)
    out["gather"] = max_diff(full_state_dict(policy.module), full)
    return out


def with_plans(trajs, seed=5):
    """Copies of ``trajs`` with one-token plans every seventh token, in the loss and out of it, each with a set
    of one to five vocabulary ids from both halves of the vocabulary (both TP ranks' slices)."""
    import dataclasses

    g = torch.Generator().manual_seed(seed)
    out = []
    for t in trajs:
        t = dataclasses.replace(t)
        t.plans = [
            (k, tuple(torch.randperm(VOCAB, generator=g)[: 1 + k % 5].tolist())) for k in range(4, len(t.token_ids), 7)
        ]
        out.append(t)
    return out


def scenario_restatement(full, trajs, ref):
    """The plans' restatement (``loss.restatement_coef``) at TP=2, through vocabulary-parallel logits, against
    one rank's per document; ``term``: how far the term moves the gradients (it must, for the check to bite)."""
    from nemo_orchestra.config import load_config

    planned = with_plans(trajs)
    ref_planned = reference(full, planned, load_config(TINY).loss, plan_coef=5.0)
    out, _, _ = run_parallel(2, 1, full, planned, ref_planned, plan_coef=5.0)
    out["term"] = max_diff(ref_planned["grads"], ref["grads"])
    out["plans"] = sum(len(t.plans) for t in planned)
    return out


def scenario_pp(full, trajs, ref):
    from nemo_orchestra.export.qwen3 import full_state_dict

    out, policy, _ = run_parallel(1, 2, full, trajs, ref)
    out["gather"] = max_diff(full_state_dict(policy.module), full)
    return out


def scenario_dp(full, trajs, ref):
    """DP=2, half the documents each (all-reduced grads); then one distributed-optimizer step."""
    from nemo_orchestra.train.step import grpo_loss_fn, train_step

    share = list(range(dist.get_rank(), len(trajs), 2))
    out, _, _ = run_parallel(1, 1, full, trajs, ref, share=share, dist_opt=False)
    # a large Adam eps keeps the update linear in tiny gradients, so fp32 rounding stays fp32-sized
    out2, policy, cfg = run_parallel(1, 1, full, trajs, ref, share=share, dist_opt=True, extra=["optim.adam_eps=1e-3"])
    batches = packed([trajs[i] for i in share], cfg.parallel, share)
    step = train_step(policy, batches, grpo_loss_fn(cfg.loss))
    expected_norm, expected = adam_step(full, ref["grads"], cfg.optim)
    out["dist_opt_grad_norm"] = abs(step["train/grad_norm"] - expected_norm)
    out["dist_opt_params"] = max_diff(snapshot(policy.module), expected)
    return out


def adam_step(full, grads, optim):
    params = {k: torch.nn.Parameter(v.clone()) for k, v in full.items()}
    for k, p in params.items():
        p.grad = grads[k].clone()
    norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), optim.grad_clip))
    opt = torch.optim.AdamW(
        list(params.values()),
        lr=optim.lr,
        betas=(optim.adam_beta1, optim.adam_beta2),
        eps=optim.adam_eps,
        weight_decay=optim.weight_decay,
    )
    opt.step()
    return norm, {k: p.detach() for k, p in params.items()}


def scenario_packed(full, trajs, ref):
    """At TP=2: one pack of all documents vs one pack per document (same loss and grads)."""
    from nemo_orchestra.train.learner import build_learner
    from nemo_orchestra.train.step import forward_backward, grpo_loss_fn, reduce_metrics

    results = {}
    for name in ("packed", "per_document"):
        layout(2, 1)
        cfg = config(2, 1, True, "parallel.microbatch_tokens=4096")
        policy = build_learner(cfg, VOCAB, torch.device("cpu"))
        load_into(policy, full)
        batches = packed(trajs, cfg.parallel) if name == "packed" else per_document(trajs, multiple=2)
        metrics = reduce_metrics(forward_backward(policy, batches, grpo_loss_fn(cfg.loss)))
        results[name] = (metrics, full_grads(policy), len(batches))
    (m1, g1, n1), (m2, g2, n2) = results["packed"], results["per_document"]
    return {"metrics": max(abs(m1[k] - m2[k]) for k in m1), "grads": max_diff(g1, g2), "packs": [n1, n2]}


def scenario_shared(full, trajs, ref):
    """Groups whose prompt is packed once (``perf.share_prompts``), at TP=2 and at PP=2, against every
    trajectory whole on one rank (sequence parallelism needs a GPU norm: not here)."""
    from nemo_orchestra.config import load_config

    grouped = grouped_trajectories()
    whole = reference(full, grouped, load_config(TINY).loss)
    tp, _, _ = run_parallel(2, 1, full, grouped, whole, share_prompts=True)
    pp, _, _ = run_parallel(1, 2, full, grouped, whole, share_prompts=True)
    return {"tp": tp, "pp": pp}


def scenario_turn(full, trajs, ref):
    """Per-turn credit (``advantage.credit=turn``) at TP=2 (shared prompts, the trainer's packing), PP=2 and
    DP=2 against the per-turn single-rank reference. Under DP each rank computes the advantages of its
    own groups, as the trainer does (a rank's rollouts are whole groups of the prompts it drew)."""
    import copy

    from nemo_orchestra.config import load_config

    loss_cfg = load_config(TINY).loss
    whole, metrics = credit_turns([t for k in range(len(TURN_GROUPS)) for t in turn_group(k, group=k)])
    turned = reference(full, whole, loss_cfg)
    episode = [copy.copy(t) for t in whole]
    for t in episode:
        t.turn_advantages = None
    episode_ref = reference(full, episode, loss_cfg)
    # the reference's advantage on each trained target, against the target's turn read off its turns' starts
    worst = 0.0
    for t, b in zip(whole, turned["docs"]):
        for p in torch.nonzero(b.loss_mask_T)[:, 0].tolist():
            turn = max(k for k, r in enumerate(t.turns) if r.start <= p + 1)
            worst = max(worst, abs(float(b.advantages_T[p]) - t.turn_advantages[turn]))

    rank = dist.get_rank()
    share = [i for i, t in enumerate(whole) if t.group == rank]
    local, _ = credit_turns(turn_group(rank, group=0))  # the rank numbers its own prompts from 0
    mine = list(whole)
    for i, t in zip(share, local, strict=True):
        mine[i] = t
    diff = torch.tensor(
        [max(abs(a - b) for i, t in zip(share, local) for a, b in zip(t.turn_advantages, whole[i].turn_advantages))]
        + [max(abs(t.advantage - whole[i].advantage) for i, t in zip(share, local))]
    )
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)

    tp, _, _ = run_parallel(2, 1, full, whole, turned, share_prompts=True)
    pp, _, _ = run_parallel(1, 2, full, whole, turned)
    dp, _, _ = run_parallel(1, 1, full, mine, turned, share=share, dist_opt=False)
    return {
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "kept": len(whole),
        "turn_credited_share": metrics["advantage/turn_credited_share"],
        # the smallest spread of one rollout's turn advantages: every rollout's differ
        "min_spread": min(max(t.turn_advantages) - min(t.turn_advantages) for t in whole),
        "reference_turn_advantages": worst,
        "episode_vs_turn_grads": max_diff(turned["grads"], episode_ref["grads"]),
        "dp_turn_advantages": float(diff[0]),
        "dp_episode_advantages": float(diff[1]),
        "dp_groups": [sorted({whole[i].group for i in share}), len(local)],
    }


def scenario_checkpoint(full, trajs, ref, folder):
    """Save at TP=2 after a step, resume at DP=2 (another layout): the next step matches."""
    from nemo_orchestra.train.checkpoint import load_checkpoint, save_checkpoint
    from nemo_orchestra.train.learner import build_learner
    from nemo_orchestra.train.step import grpo_loss_fn, train_step

    rank = dist.get_rank()
    layout(2, 1)
    cfg = config(2, 1)
    policy = build_learner(cfg, VOCAB, torch.device("cpu"))
    load_into(policy, full)
    train_step(policy, packed(trajs[:3], cfg.parallel), grpo_loss_fn(cfg.loss))
    saved = save_checkpoint(folder, 1, policy, {"data_position": 1}, 2, rank, cfg.model, VOCAB)
    w1 = snapshot(policy.module)
    step_tp = train_step(policy, packed(trajs[3:], cfg.parallel), grpo_loss_fn(cfg.loss))
    w2_tp = snapshot(policy.module)

    layout(1, 1)
    cfg = config(1, 1)
    policy = build_learner(cfg, VOCAB, torch.device("cpu"))
    common = load_checkpoint(saved, policy, rank)
    w1_dp = snapshot(policy.module)
    mine = [trajs[3:][i] for i in range(rank, len(trajs) - 3, 2)]
    step_dp = train_step(policy, packed(mine, cfg.parallel), grpo_loss_fn(cfg.loss))
    w2_dp = snapshot(policy.module)
    return {
        "restored_weights": max_diff(w1_dp, w1),
        "next_step_weights": max_diff(w2_dp, w2_tp),
        "next_step_loss": abs(step_dp["loss/pg"] - step_tp["loss/pg"]),
        "common_step": common["step"],
        "data_position": common["data_position"],
        "files": sorted(os.listdir(saved)),
    }


def scenario_hf_tp2(folder):
    """A tiny random transformers Qwen3 imported at TP=2 (model.init_from): logits and export."""
    from transformers import Qwen3ForCausalLM

    from nemo_orchestra.export.qwen3 import full_state_dict, hf_config, megatron_to_hf
    from nemo_orchestra.megatron.forward import forward_logprobs
    from nemo_orchestra.train.packing import pack
    from nemo_orchestra.train.learner import build_learner
    from tests.helpers import traj

    layout(2, 1)
    cfg = config(2, 1, True, f"model.init_from={folder}", "model.tie_embeddings=false")
    if dist.get_rank() == 0:
        torch.manual_seed(5)
        hf = Qwen3ForCausalLM(hf_config(cfg.model, VOCAB))
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
        hf.save_pretrained(folder)
    dist.barrier()
    hf = Qwen3ForCausalLM.from_pretrained(folder).eval()
    policy = build_learner(cfg, VOCAB, torch.device("cpu"))
    g = torch.Generator().manual_seed(9)
    docs = [traj(ids=torch.randint(0, VOCAB, (n,), generator=g).tolist()) for n in (23, 9)]
    batches = pack(docs, 64, pad_to_multiple=2)
    lps = forward_logprobs(policy.model, batches, torch.device("cpu"))
    worst = 0.0
    with torch.no_grad():
        for j, got in doc_values(batches, lps).items():
            t = docs[j]
            logits = hf(torch.tensor([t.token_ids])).logits[0].float()
            want = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(t.token_ids[1:])[:, None])[:, 0]
            worst = max(worst, float((got[:-1] - want).abs().max()))
    exported = megatron_to_hf(full_state_dict(policy.module), cfg.model)
    original = hf.state_dict()
    exact = set(exported) == set(original) and all(torch.equal(exported[k], original[k]) for k in exported)
    return {"logprobs_vs_transformers": worst, "export_equals_import": exact}


SCENARIOS = ("tp", "pp", "dp", "packed", "shared", "turn", "restatement", "checkpoint", "hf_tp2")


def run_rank(rank: int, world: int, port: int, out_dir: str, names: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from nemo_orchestra.config import load_config
    from nemo_orchestra.megatron import cpu_compat

    cpu_compat.install()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    full = full_weights()
    trajs = trajectories()
    ref = reference(full, trajs, load_config(TINY).loss)
    shared = os.path.join(out_dir, "shared")
    for name in names:
        try:
            if name == "checkpoint":
                results[name] = scenario_checkpoint(full, trajs, ref, os.path.join(shared, "ckpt"))
            elif name == "hf_tp2":
                results[name] = scenario_hf_tp2(os.path.join(shared, "hf"))
            else:
                results[name] = globals()[f"scenario_{name}"](full, trajs, ref)
        except Exception:  # noqa: BLE001 - reported to the test, which fails naming it
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


def spawn(names=SCENARIOS, world: int = 2) -> dict:
    """Run the scenarios on ``world`` gloo ranks; the results of rank 0."""
    import torch.multiprocessing as mp

    from nemo_orchestra.megatron.parallel import _free_port

    with tempfile.TemporaryDirectory() as out_dir:
        os.makedirs(os.path.join(out_dir, "shared"))
        mp.spawn(run_rank, args=(world, _free_port(), out_dir, list(names)), nprocs=world, join=True)
        with open(os.path.join(out_dir, "results.json")) as f:
            return json.load(f)
