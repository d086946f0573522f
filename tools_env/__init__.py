"""Tool-environment service: episodes, tools, sandbox and answer verification over HTTP."""
