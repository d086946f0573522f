"""Tiny builders for hand-checkable tests."""

from nemo_orchestra.config import AdvantageConfig, LossConfig, RewardConfig
from nemo_orchestra.types import Trajectory
from tools_env.task import TaskRecord


def task(preference=None, category="lookup") -> TaskRecord:
    return TaskRecord(
        problem="q?", answer="a", category=category, tools=["expert", "answer"], preference=preference or {}
    )


def traj(correct=True, cost=0.0, latency=0.0, group=0, t=None, counts=None, ids=None, mask=None) -> Trajectory:
    ids = ids or [1, 2, 3]
    return Trajectory(
        task=t or task(),
        group=group,
        token_ids=list(ids),
        loss_mask=list(mask or [0] * len(ids)),
        gen_logprobs=[0.0] * len(ids),
        prompt_len=1,
        correct=correct,
        tool_cost=cost,
        latency_s=latency,
        call_latencies_s=[latency] if latency else [],  # one call, as the agent loop records them
        tool_counts=counts or {},
    )


def reward_cfg(
    name="full",
    efficiency=True,
    preference=True,
    scalarization="linear",
    normalize="minmax",
    latency_resolution_s=0.01,
    **weights,
) -> RewardConfig:
    return RewardConfig(
        name=name,
        use_efficiency=efficiency,
        use_preference=preference,
        scalarization=scalarization,
        normalize=normalize,
        latency_resolution_s=latency_resolution_s,
        default_preference=weights or {"accuracy": 1.0, "cost": 1.0, "latency": 1.0},
    )


def adv_cfg(**kw) -> AdvantageConfig:
    """Episode credit, std mode, every group kept, no rollout filtered; ``kw`` overrides."""
    base = dict(
        mode="std",
        eps=1e-6,
        clip=3.0,
        min_group_std=0.0,
        drop_format_errors=False,
        drop_unanswered=False,
        train_malformed_calls=False,
        credit="episode",
    )
    base.update(kw)
    return AdvantageConfig(**base)


def loss_cfg(**kw) -> LossConfig:
    base = dict(
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=10.0,
        kl_coef=0.0,
        tis_cap=None,
        minibatches=1,
        copy_lesson_coef=0.0,
        copy_lessons_per_step=0,
    )
    base.update(kw)
    return LossConfig(**base)


def generated_logprobs(gpt, prompts, gens, temperature: float = 1.0):
    """The trainer's logprob of each generated token of ``gens`` (engine outputs for ``prompts``),
    computed on the packed trajectories as in the GRPO step."""

    from nemo_orchestra.megatron.forward import forward_logprobs
    from nemo_orchestra.train.packing import pack

    trajs = [traj(ids=p + g.token_ids, mask=[0] * len(p) + [1] * len(g.token_ids)) for p, g in zip(prompts, gens)]
    (batch,) = pack(trajs, capacity=4096)
    lp = forward_logprobs(gpt, batch, next(gpt.parameters()).device, temperature)
    out = [None] * len(trajs)
    for j, (s, e) in enumerate(zip(batch.cu_seqlens_B1[:-1].tolist(), batch.cu_seqlens_B1[1:].tolist())):
        i = batch.traj_index_B[j]
        out[i] = lp[s + len(prompts[i]) - 1 : e - 1]
    return out


# a 2-layer model of a few hundred thousand parameters: Megatron-Core's code paths at test speed
TINY_MODEL = [
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.head_dim=16",
    "model.num_layers=2",
]

# a recipe run of a few seconds a step: small groups, one turn, in-process generation, no evaluation
SHORT_RUN = [
    "data.num_train_tasks=32",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_turns=1",
    "rollout.max_new_tokens_per_turn=16",
    "evaluation.enabled=false",
    "rollout.engine=hf",
]
