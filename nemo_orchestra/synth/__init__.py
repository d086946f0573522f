"""Synthetic task data (ToolScale-style): QA and domain tasks with verifiable ground truth, as task records."""

from nemo_orchestra.synth.pipeline import LLMOptions, SynthConfig, synthesize

__all__ = ["LLMOptions", "SynthConfig", "synthesize"]
