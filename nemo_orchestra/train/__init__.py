"""The policy side of GRPO: the trainer's stages, the policy and its update, rollouts ahead of
training, the warm start, checkpoints, the metric logger, FLOPs and the memory plan, the run report."""
