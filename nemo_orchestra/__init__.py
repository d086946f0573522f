"""nemo-orchestra: GRPO training of tool-orchestrating LLMs on Megatron-Core."""

__version__ = "0.1.0"
