"""Benchmarks run by recipes/benchmark.py: the tool service and the GRPO step."""
