"""Evaluation: run policies (fixed routing baselines, chat models, checkpoints) through the tool service."""

from nemo_orchestra.evaluation.policy import POLICIES, Policy, PolicyInput, ToolCall, build_policy

__all__ = ["POLICIES", "Policy", "PolicyInput", "ToolCall", "build_policy"]
