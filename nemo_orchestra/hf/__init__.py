"""Hugging Face interop: Qwen3 weight-name mapping, config, export folder."""
