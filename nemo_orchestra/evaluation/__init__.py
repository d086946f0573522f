"""Evaluation: run policies (fixed routing baselines, chat models, checkpoints) through the tool service,
in the agent loop training uses."""

from nemo_orchestra.evaluation.policies import POLICIES, Policy, build_policy

__all__ = ["POLICIES", "Policy", "build_policy"]
