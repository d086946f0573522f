"""What to train on the policy side: trainer stages, the policy and its step, warm start, checkpoints, metrics."""
