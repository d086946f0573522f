"""The orchestrator's prompt: the chat format, the tokenizer, and the messages a task starts from."""
