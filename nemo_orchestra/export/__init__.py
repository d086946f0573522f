"""Checkpoint formats beyond our own: the Qwen3 weight-name mapping between Megatron-Core and Hugging
Face (``qwen3``, ``convert``: import and export), the Hugging Face folder (``hf``) and the
TensorRT-LLM checkpoint layout (``trtllm``)."""
