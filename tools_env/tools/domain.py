"""Domain tools: every function of every ToolScale-style domain as a service tool.

``bank_transfer``, ``railway_book_ticket``, ... (``<domain>_<function>``: OpenAI-compatible
function names allow no dots). Each call runs on the episode's private copy of the domain
database (``<workdir>/domains/<domain>.sqlite``, created from the seeded database on first
use), so episodes never see each other's writes. A request the data or the policy refuses is
an error observation, never an exception. Config (per tool or shared): ``cost_per_call`` ($,
default 0).
"""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from tools_env.domains import DOMAINS, episode_db
from tools_env.domains.base import Domain, DomainError, DomainFunction
from tools_env.tools.base import EpisodeContext, Tool, ToolArgumentError, ToolResult, register_tool


class DomainTool(Tool):
    domain: Domain
    function: DomainFunction

    async def call(self, arguments: dict[str, Any], ctx: EpisodeContext) -> ToolResult:
        t0 = time.perf_counter()
        try:
            arguments = self.check_arguments(arguments)
        except ToolArgumentError as e:
            return ToolResult(observation=f"error: {e}", error=str(e))
        db = episode_db(ctx, self.domain)
        try:
            result = self.domain.call(db, self.function.name, arguments)
            observation, error = json.dumps(result, sort_keys=True), None
        except DomainError as e:
            observation, error = f"error: {e}", str(e)
        except (sqlite3.Error, TypeError, ValueError) as e:  # arguments that passed the schema but not SQLite
            observation, error = f"error: {self.name} failed: {e}", f"{type(e).__name__}: {e}"
        finally:
            db.conn.close()
        cost = float(self.config.get("cost_per_call", 0.0))
        return ToolResult(
            observation=observation,
            cost=cost,
            latency_s=time.perf_counter() - t0,
            error=error,
            meta={"domain": self.domain.name, "writes": self.function.writes},
        )


def _make_tool(domain: Domain, fn: DomainFunction) -> type[DomainTool]:
    name = domain.tool_name(fn.name)
    cls = type(
        name,
        (DomainTool,),
        {
            "name": name,
            "description": f"[{domain.name}: {domain.description}] {fn.description}",
            "parameters": fn.parameters,
            "domain": domain,
            "function": fn,
        },
    )
    return register_tool(cls)


DOMAIN_TOOLS: dict[str, type[DomainTool]] = {
    domain.tool_name(fn.name): _make_tool(domain, fn) for domain in DOMAINS.values() for fn in domain.functions.values()
}
