"""Megatron-Core glue: CPU compatibility, the Qwen3 layer spec, model construction, parallel state."""
