"""Counters of one service process, rendered in the Prometheus text format at ``GET /metrics``.

Kept as plain dicts so the hot path is a few dictionary increments; no client library.
Tool labels are registered tool names only: a policy calling a made-up tool is counted under
``tool="_unknown"``, so a policy cannot blow up the label space.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
UNKNOWN_TOOL = "_unknown"


class Histogram:
    __slots__ = ("counts", "total", "n")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS_S, value)] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, labels: str) -> list[str]:
        sep = "," if labels else ""
        lines, cum = [], 0
        for bound, count in zip((*LATENCY_BUCKETS_S, "+Inf"), self.counts):
            cum += count
            lines.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {cum}')
        braced = f"{{{labels}}}" if labels else ""
        lines.append(f"{name}_sum{braced} {self.total!r}")
        lines.append(f"{name}_count{braced} {self.n}")
        return lines


class Metrics:
    def __init__(self) -> None:
        self.episodes_created = 0
        self.episodes_deleted = 0
        self.episodes_expired = 0
        self.episodes_finished: dict[str, int] = defaultdict(int)  # by how: answer, max_turns, ...
        self.outcomes: dict[bool, int] = defaultdict(int)
        self.tool_calls: dict[str, int] = defaultdict(int)
        self.tool_errors: dict[str, int] = defaultdict(int)
        self.tool_cost: dict[str, float] = defaultdict(float)
        self.tool_latency: dict[str, Histogram] = defaultdict(Histogram)  # as reported by the tool
        self.step_seconds = Histogram()  # service-side time to handle a step
        self.http_errors: dict[str, int] = defaultdict(int)  # by error code

    def record_step(self, tool: str, cost: float, latency_s: float, error: bool, step_s: float) -> None:
        self.tool_calls[tool] += 1
        if error:
            self.tool_errors[tool] += 1
        if cost:
            self.tool_cost[tool] += cost
        self.tool_latency[tool].observe(latency_s)
        self.step_seconds.observe(step_s)

    def render(self, gauges: dict[str, float]) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[tuple[str, object]]) -> None:
            out.append(f"# HELP tools_env_{name} {help_}")
            out.append(f"# TYPE tools_env_{name} {kind}")
            for labels, value in samples:
                out.append(f"tools_env_{name}{{{labels}}} {value}" if labels else f"tools_env_{name} {value}")

        for key, value in gauges.items():
            family(key, "gauge", key.replace("_", " "), [("", value)])
        family("episodes_created_total", "counter", "episodes created", [("", self.episodes_created)])
        family("episodes_deleted_total", "counter", "episodes deleted", [("", self.episodes_deleted)])
        family(
            "episodes_expired_total", "counter", "episodes expired after the idle TTL", [("", self.episodes_expired)]
        )
        family(
            "episodes_finished_total",
            "counter",
            "episodes ended, by answer or by a guard",
            [(f'how="{k}"', v) for k, v in sorted(self.episodes_finished.items())],
        )
        family(
            "outcomes_total",
            "counter",
            "verified answers",
            [(f'correct="{str(k).lower()}"', v) for k, v in sorted(self.outcomes.items())],
        )
        family(
            "tool_calls_total",
            "counter",
            "tool calls (turns), including erroneous ones",
            [(f'tool="{k}"', v) for k, v in sorted(self.tool_calls.items())],
        )
        family(
            "tool_errors_total",
            "counter",
            "tool calls that returned an error observation",
            [(f'tool="{k}"', v) for k, v in sorted(self.tool_errors.items())],
        )
        family(
            "tool_cost_dollars_total",
            "counter",
            "dollars charged by tool calls",
            [(f'tool="{k}"', repr(v)) for k, v in sorted(self.tool_cost.items())],
        )
        family(
            "http_errors_total",
            "counter",
            "structured 4xx/5xx responses, by error code",
            [(f'code="{k}"', v) for k, v in sorted(self.http_errors.items())],
        )
        out.append("# HELP tools_env_tool_latency_seconds latency reported by tool calls")
        out.append("# TYPE tools_env_tool_latency_seconds histogram")
        for tool, hist in sorted(self.tool_latency.items()):
            out.extend(hist.render("tools_env_tool_latency_seconds", f'tool="{tool}"'))
        out.append("# HELP tools_env_step_seconds time the service spent handling a step")
        out.append("# TYPE tools_env_step_seconds histogram")
        out.extend(self.step_seconds.render("tools_env_step_seconds", ""))
        return "\n".join(out) + "\n"
