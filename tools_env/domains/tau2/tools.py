"""Every agent tool of tau2's airline, retail and telecom domains as a service tool ``<domain>_<tool>``.

The schemas are tau2's own (``Tool.openai_schema``), renamed; a call runs tau2's implementation on
the episode's environment (``episode.run_agent_call``), so the conversation tau2's evaluator sees
holds the tool's own name and tau2's own result text. Arguments are checked for names only: tau2's
tools report wrong values themselves (``Error: ...``), as they do in tau2.

Registration is explicit (``register_all``): the service registers them when its config names a
user, since a tau2 task cannot run without one.
"""

from __future__ import annotations

import time
from typing import Any

from tools_env.tools.base import TOOL_REGISTRY, EpisodeContext, Tool, ToolResult, register_tool


class Tau2Tool(Tool):
    domain: str = ""
    tau2_name: str = ""

    def check_arguments(self, arguments: Any) -> dict[str, Any]:
        self.check_argument_names(arguments)
        return arguments

    async def call(self, arguments: dict[str, Any], ctx: EpisodeContext) -> ToolResult:
        from tools_env.domains.tau2.episode import run_agent_call

        t0 = time.perf_counter()
        if (ctx.task.meta or {}).get("tau2", {}).get("domain") != self.domain:
            message = f"{self.name} is a tool of tau2's {self.domain} domain, which this task is not in"
            return ToolResult(observation=f"error: {message}", error=message)
        observation, failed = run_agent_call(ctx, self.tau2_name, arguments)
        return ToolResult(
            observation=observation,
            latency_s=time.perf_counter() - t0,
            error=observation if failed else None,
            meta={"domain": f"tau2/{self.domain}"},
        )


def tool_schemas(domain: str) -> list[dict[str, Any]]:
    """tau2's function schemas of the domain's agent tools (``{"name", "description", "parameters"}``)."""
    from tools_env.domains.tau2.episode import environment

    return [t.openai_schema["function"] for t in environment(domain).get_tools()]


def service_name(domain: str, name: str) -> str:
    return f"{domain}_{name}"


def register_all() -> list[str]:
    """Register every domain's agent tools (once per process); their service names."""
    from tools_env.domains.tau2.episode import DOMAINS

    names = []
    for domain in DOMAINS:
        for fn in tool_schemas(domain):
            name = service_name(domain, fn["name"])
            names.append(name)
            if name in TOOL_REGISTRY:
                continue
            attrs = {
                "name": name,
                "description": fn.get("description", ""),
                "parameters": fn["parameters"],
                "domain": domain,
                "tau2_name": fn["name"],
            }
            register_tool(type(f"tau2_{name}", (Tau2Tool,), attrs))
    return names
