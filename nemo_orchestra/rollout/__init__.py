"""Rollouts: the generation engine and the multi-turn loop against the tool service."""
