"""One tau2 task as an episode: its own environment, the conversation in tau2's messages, the user.

An episode holds a fresh environment of its domain (tau2's own constructor: a new copy of the
domain's database, set to the task's initial state), the conversation as tau2's ``Message``
objects (what tau2's evaluator grades), and the simulated user.

- A call of a domain tool (``<domain>_<tool>``) is an assistant tool call: it runs through the
  environment's ``get_response``, as in tau2, and both messages are recorded.
- ``answer(text)`` is the assistant's message to the user. The agent ends the conversation with
  ``###STOP###`` in it (tau2's agent stop); otherwise the user replies, calling its own tools
  first where the domain gives it some (telecom's device), and that reply is the answer's
  observation. A reply with ``###STOP###``, ``###TRANSFER###`` or ``###OUT-OF-SCOPE###`` ends
  the conversation (tau2's user stop) and the episode is graded.

The user is tau2's ``UserSimulator`` (its guidelines, the task's scenario, its stop rules) over
the configured endpoint (litellm's OpenAI-compatible client), or, with ``user: replay``, the
task's own script: the reason for the call and the known facts, the user-side gold actions, and
a stop after the agent's next message (the oracle's user, for tests and checks).
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from typing import Any

from tools_env.domains.tau2.package import require_tau2

DOMAINS = ("airline", "retail", "telecom")
MAX_USER_TOOL_ROUNDS = 10  # user tool calls in a row before the user must speak
USER_NOT_CONFIGURED = (
    "tau2 tasks need a simulated user: set the service config's 'user' to an OpenAI-compatible endpoint "
    "({base_url, model, price_in, price_out}) or to 'replay' (the task's gold script)"
)


def environment(domain: str) -> Any:
    """A fresh tau2 environment of ``domain`` (its own copy of the database)."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown tau2 domain {domain!r}; domains: {', '.join(DOMAINS)}")
    return require_tau2(f"tau2.domains.{domain}.environment").get_environment()


def parse_task(record_meta: dict[str, Any]) -> Any:
    """The tau2 ``Task`` a record carries in ``meta.tau2.task``."""
    tasks = require_tau2("tau2.data_model.tasks")
    return tasks.Task.model_validate(record_meta["task"])


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


@dataclass
class Tau2Episode:
    domain: str
    task: Any  # tau2 Task
    env: Any  # tau2 Environment
    user: Any  # UserSimulator or ReplayUser
    user_state: Any
    messages: list[Any] = field(default_factory=list)
    termination: str | None = None  # tau2 TerminationReason value once the conversation ended
    user_latency_s: float = 0.0
    user_cost: float = 0.0
    user_usage: dict[str, int] = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0})
    calls: int = 0
    started: str = field(default_factory=_now)  # when the episode's tau2 state was made
    started_s: float = field(default_factory=time.monotonic)


def episode_state(ctx: Any, user_cfg: Any = None) -> Tau2Episode:
    """The episode's tau2 state, made on first use (``user_cfg`` is needed by then for the user)."""
    state = ctx.state.get("tau2")
    if state is not None:
        return state
    meta = (ctx.task.meta or {}).get("tau2")
    if not isinstance(meta, dict) or "task" not in meta:
        raise ValueError(f"task {ctx.task.id} has no meta.tau2 task (write tau2 tasks with recipes/import_tau2.py)")
    task = parse_task(meta)
    env = environment(meta["domain"])
    init = task.initial_state
    env.set_state(
        initialization_data=init.initialization_data if init else None,
        initialization_actions=init.initialization_actions if init else None,
        message_history=[],
    )
    user = make_user(user_cfg, task, env)
    state = Tau2Episode(meta["domain"], task, env, user, user.get_init_state())
    ctx.state["tau2"] = state
    return state


def make_user(user_cfg: Any, task: Any, env: Any) -> Any:
    if user_cfg is None:
        raise ValueError(USER_NOT_CONFIGURED)
    user_tools = env.get_user_tools() if env.user_tools is not None else None
    if user_cfg == "replay":
        return ReplayUser(task, user_tools)
    sim = require_tau2("tau2.user.user_simulator")
    key = os.environ.get(user_cfg.api_key_env) if user_cfg.api_key_env else None
    llm_args: dict[str, Any] = {"api_base": user_cfg.base_url, "api_key": key or "EMPTY", "num_retries": 0}
    llm_args["timeout"] = user_cfg.timeout_s
    if user_cfg.temperature is not None:
        llm_args["temperature"] = user_cfg.temperature
    if user_cfg.max_tokens is not None:
        llm_args["max_tokens"] = user_cfg.max_tokens
    return sim.UserSimulator(
        tools=user_tools,
        instructions=str(task.user_scenario),
        llm=f"openai/{user_cfg.model}",
        llm_args=llm_args,
    )


def user_action_groups(task: Any) -> list[list[Any]]:
    """The task's user-side gold actions in the gold order, grouped by the agent's actions between them:
    group 0 comes before the agent's first action, group i after the agent's i-th run of actions."""
    crit = task.evaluation_criteria
    groups: list[list[Any]] = [[]]
    last = "user"
    for a in (crit.actions or []) if crit else []:
        if a.requestor == "user":
            if last == "assistant":
                groups.append([])
            groups[-1].append(a)
        last = a.requestor
    return groups


class ReplayUser:
    """The task's own user, for the oracle: each reply first does the next group of user-side gold
    actions (``user_action_groups``), then speaks (the reason for the call and the known facts at first,
    then that it is done); after the last group, the next reply is a stop."""

    def __init__(self, task: Any, tools: Any) -> None:
        self.task = task
        self.groups = user_action_groups(task)
        self.replies = 0
        self.pending: list[Any] = []

    def get_init_state(self) -> dict[str, Any]:
        return {}

    def generate_next_message(self, message: Any, state: Any) -> tuple[Any, Any]:
        m = require_tau2("tau2.data_model.message")
        if getattr(message, "role", "") != "tool":  # an agent message: this reply's user actions first
            if self.replies >= len(self.groups):
                return m.UserMessage(role="user", content="###STOP###"), state
            self.pending = list(self.groups[self.replies])
            self.replies += 1
            if self.pending:
                calls = [
                    m.ToolCall(
                        id=f"user_{self.replies}_{i}", name=a.name, arguments=dict(a.arguments), requestor="user"
                    )
                    for i, a in enumerate(self.pending)
                ]
                return m.UserMessage(role="user", content=None, tool_calls=calls), state
        if self.replies > 1:
            return m.UserMessage(role="user", content="Done. What next?"), state
        ins = self.task.user_scenario.instructions
        if isinstance(ins, str):
            text = ins
        else:
            text = "\n".join(str(x) for x in (ins.reason_for_call, ins.known_info) if x)
        return m.UserMessage(role="user", content=text), state


def run_agent_call(ctx: Any, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
    """One assistant tool call on the episode's environment: tau2's tool message text, and whether it failed."""
    m = require_tau2("tau2.data_model.message")
    state = episode_state(ctx)
    state.calls += 1
    call = m.ToolCall(id=f"call_{state.calls}", name=name, arguments=dict(arguments), requestor="assistant")
    state.messages.append(m.AssistantMessage(role="assistant", content=None, tool_calls=[call]))
    reply = state.env.get_response(call)
    state.messages.append(reply)
    return reply.content or "", bool(reply.error)


def end_turn(ctx: Any, text: str, user_cfg: Any) -> str | None:
    """The assistant said ``text`` to the user: the user's reply, or None when the conversation ended."""
    m = require_tau2("tau2.data_model.message")
    sim = require_tau2("tau2.user.user_simulator")
    state = episode_state(ctx, user_cfg)
    assert state.termination is None, "a finished tau2 conversation takes no more turns"
    said = m.AssistantMessage(role="assistant", content=text)
    state.messages.append(said)
    if "###STOP###" in text:
        state.termination = "agent_stop"
        return None
    message: Any = said
    turn = {"latency_s": 0.0, "cost": 0.0, "usage": {"prompt_tokens": 0, "completion_tokens": 0}}
    ctx.state["user_turn"] = turn  # the user's, not the policy's (tools_env.tools.answer)
    for _ in range(MAX_USER_TOOL_ROUNDS + 1):
        t0 = time.perf_counter()
        reply, state.user_state = state.user.generate_next_message(copy.deepcopy(message), state.user_state)
        seconds = time.perf_counter() - t0
        cost = user_cost(user_cfg, getattr(reply, "usage", None) or {})
        state.user_latency_s += seconds
        state.user_cost += cost
        turn["latency_s"] += seconds
        turn["cost"] += cost
        for k in state.user_usage:
            n = int((getattr(reply, "usage", None) or {}).get(k, 0) or 0)
            state.user_usage[k] += n
            turn["usage"][k] += n
        state.messages.append(reply)
        if not reply.is_tool_call():
            if sim.UserSimulator.is_stop(reply):
                state.termination = "user_stop"
                return None
            return reply.content or ""
        results = [state.env.get_response(call) for call in reply.tool_calls]
        state.messages.extend(results)
        message = results[0] if len(results) == 1 else m.MultiToolMessage(role="tool", tool_messages=results)
    state.termination = "too_many_errors"
    return None


def user_cost(user_cfg: Any, usage: dict[str, Any]) -> float:
    """The user's tokens at the configured user prices ($ per 1M tokens); the replay user costs nothing."""
    if user_cfg is None or user_cfg == "replay":
        return 0.0
    tokens_in, tokens_out = int(usage.get("prompt_tokens", 0) or 0), int(usage.get("completion_tokens", 0) or 0)
    return (tokens_in * user_cfg.price_in + tokens_out * user_cfg.price_out) / 1e6


def simulation(ctx: Any) -> Any:
    """The episode as tau2's ``SimulationRun`` (what tau2's evaluator and its tooling read): its start is
    when the episode's tau2 state was made, its end and duration now."""
    sim = require_tau2("tau2.data_model.simulation")
    state = ctx.state.get("tau2")
    now = _now()
    reason = state.termination if state is not None and state.termination else "max_steps"
    return sim.SimulationRun(
        id=ctx.episode_id,
        task_id=str(ctx.task.meta["tau2"]["task"]["id"]),
        timestamp=now,
        start_time=state.started if state is not None else now,
        end_time=now,
        duration=time.monotonic() - state.started_s if state is not None else 0.0,
        termination_reason=reason,
        user_cost=state.user_cost if state is not None else 0.0,
        messages=list(state.messages) if state is not None else [],
    )


def use_judge(judge_cfg: Any) -> None:
    """tau2's NL-assertion judge is the service's judge endpoint (tau2 reads its model from module constants)."""
    nl = require_tau2("tau2.evaluator.evaluator_nl_assertions")
    key = os.environ.get(judge_cfg.api_key_env) if judge_cfg.api_key_env else None
    nl.DEFAULT_LLM_NL_ASSERTIONS = f"openai/{judge_cfg.model}"
    nl.DEFAULT_LLM_NL_ASSERTIONS_ARGS = {
        "temperature": 0.0,
        "api_base": judge_cfg.base_url,
        "api_key": key or "EMPTY",
        "timeout": judge_cfg.timeout_s,
    }


def grade(ctx: Any, judge_cfg: Any = None) -> tuple[float, str, Any]:
    """tau2's ``evaluate_simulation`` on the episode: reward, a reason, and tau2's ``RewardInfo``.

    NL assertions need an LLM judge: the service's ``judge`` endpoint. Without one a task whose basis
    holds them is graded on the rest of its basis, and the reason says the assertions were skipped.
    """
    ev = require_tau2("tau2.evaluator.evaluator")
    judged = judge_cfg is not None
    if judged:
        use_judge(judge_cfg)
    tasks = require_tau2("tau2.data_model.tasks")
    task = parse_task(ctx.task.meta["tau2"])
    skipped = ""
    basis = task.evaluation_criteria.reward_basis if task.evaluation_criteria else []
    if not judged and tasks.RewardType.NL_ASSERTION in basis:
        task = task.model_copy(deep=True)
        task.evaluation_criteria.reward_basis = [b for b in basis if b != tasks.RewardType.NL_ASSERTION]
        skipped = "; nl_assertions skipped (no judge configured)"
    kind = ev.EvaluationType.ALL_WITH_NL_ASSERTIONS if judged else ev.EvaluationType.ALL
    info = ev.evaluate_simulation(simulation(ctx), task, kind, solo_mode=False, domain=ctx.task.meta["tau2"]["domain"])
    shown = ",".join(b.value for b in (info.reward_basis or [])) or "none"
    note = (info.info or {}).get("note", "") if isinstance(info.info, dict) else ""
    reason = f"tau2 reward {info.reward:g} (basis {shown}){skipped}" + (f"; {note}" if note else "")
    return float(info.reward), reason, info
