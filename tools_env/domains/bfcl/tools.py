"""Every function of BFCL's eight multi-turn API classes as a service tool, under its BFCL name.

``ls``, ``post_tweet``, ``place_order``, ... with BFCL's own function docs as their schemas
(``apis.json_schema``); the names do not collide with each other or with the service's other
tools. A call runs on the episode's own API instances (``checker.episode_state``: created from
the task's initial configuration on first use), so concurrent episodes of the same entry never
see each other's state. Arguments are checked for names only (unknown, missing required), as
BFCL's executor would fail such a call; values reach the API method as they are, as in BFCL.
Without the bfcl-eval package nothing is registered (a BFCL task is then refused with the
``bfcl`` verifier's error, which names the extra).
"""

from __future__ import annotations

import time
from typing import Any

from tools_env.domains.bfcl.package import available
from tools_env.tools.base import EpisodeContext, Tool, ToolResult, register_tool


class BfclTool(Tool):
    bfcl_class: str = ""

    def check_arguments(self, arguments: Any) -> dict[str, Any]:
        """Names only: BFCL's function docs use their own type names (dict, float, any), and its
        functions report wrong values themselves, as BFCL's executions do."""
        self.check_argument_names(arguments)
        return arguments

    async def call(self, arguments: dict[str, Any], ctx: EpisodeContext) -> ToolResult:
        from tools_env.domains.bfcl.checker import episode_state, run_call

        t0 = time.perf_counter()
        if self.bfcl_class not in episode_state(ctx).instances:
            message = f"{self.name} belongs to {self.bfcl_class}, which this task does not involve"
            return ToolResult(observation=f"error: {message}", error=message)
        observation = run_call(ctx, self.name, arguments)
        error = observation if observation.startswith("Error during execution") else None
        return ToolResult(
            observation=observation,
            latency_s=time.perf_counter() - t0,
            error=error,
            meta={"domain": "bfcl", "class": self.bfcl_class},
        )


def _make_tool(class_name: str, doc: dict[str, Any]) -> type[BfclTool]:
    from tools_env.domains.bfcl.apis import json_schema

    cls = type(
        f"bfcl_{doc['name']}",
        (BfclTool,),
        {
            "name": doc["name"],
            "description": doc["description"],
            "parameters": json_schema(doc["parameters"]),
            "bfcl_class": class_name,
        },
    )
    return register_tool(cls)


def _register_all() -> dict[str, type[BfclTool]]:
    if not available()[0]:
        return {}
    from tools_env.domains.bfcl.apis import CLASSES, function_docs

    return {doc["name"]: _make_tool(cls, doc) for cls in CLASSES for doc in function_docs(cls)}


BFCL_TOOLS: dict[str, type[BfclTool]] = _register_all()
