"""Warm start: teach the tool-call format by SFT on scripted trajectories from the real service.

A scripted orchestrator makes random valid choices for each task: first the calculator with the
problem's expression (when it has one), a multi-step task's chain (``chain_call``: a search for each
entity, its query written by a random expert alias, then the answer written by a random expert alias
from the two results), a random expert alias asked the problem, or straight to ``answer`` written by a
random expert alias; after a tool result, ``answer`` with what the tool said or written by
a random expert alias. Each turn opens with a short plan that restates the kind of task and the
user's preference and then names the call (``plan_text``; one token with the embedded tokenizer),
so the choice is made together with what it should depend on. The episodes run against the tool
service, so observations are exactly what the policy will see; the assistant turns are the only
trained tokens. The learning rate decays along a cosine (``warm_start.min_lr_ratio``), so the policy
ends on the data's even odds for each kind and preference. Which choices pay off under which
plan is left for GRPO to find.

Copy lessons (``warm_start.copy_lessons``): a small model does not learn from a few hundred examples to
copy a problem's expression into the calculator call or a tool's result into its answer, so
calculator-then-answer (free and exact) fails and GRPO learns to pay an expert instead. A copy
lesson calls the calculator (or an expert) on the problem and then answers with what it returned;
its calls are trained but not its plans, so the choice of actions keeps the even odds of the
scripted episodes while the copies get many more examples. The copied spans vary in length (1 to 4
digit operands and 1 to 8 character results in ``copy_tasks``' arithmetic, names inside an expert's
sentence) and in position, so the model learns to find and copy them rather than a fixed offset; a third
of the arithmetic has a repeated digit, where copying by what followed the current token is ambiguous.
"""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import dataclass

from nemo_orchestra.config import RewardConfig
from nemo_orchestra.data.default_tasks import MULTISTEP_RE, plan, plan_text

from nemo_orchestra.prompting.chat import (
    ChatFormat,
    ChatTemplateError,
    Transcript,
    render_chat,
    tool_call_message,
    tool_message,
)
from nemo_orchestra.prompting.prompts import task_messages, with_default_preference
from nemo_orchestra.types import TaskRecord, Trajectory, TurnRecord

_EXPR_RE = re.compile(r"What is (-?\d+ [-+*] -?\d+)\?")
_ANSWER_RE = re.compile(r"The answer is (.+?)\.?\s*$", re.DOTALL)


@dataclass
class ScriptedEpisode:
    task: TaskRecord
    tools: list[dict]
    turns: list[tuple[str, dict, str]]  # (tool name, arguments, observation) per turn
    copy: bool = False  # a copy lesson: its calls are trained, not its plans


def _aliases(tools: list[dict], avoid: frozenset = frozenset()) -> list[str]:
    """The expert aliases the episode's ``answer`` tool can hand the final answer to, but ``avoid``."""
    for t in tools:
        if t["function"]["name"] == "answer":
            enum = t["function"]["parameters"]["properties"].get("model", {}).get("enum", [])
            return [a for a in enum if a not in avoid]
    return []


def _choose(
    task: TaskRecord,
    tools: list[dict],
    rng: random.Random,
    copy: bool = False,
    avoid: frozenset = frozenset(),
    calls_only: bool = False,
) -> tuple[str, dict]:
    """The first action: the calculator, an expert, or the final answer written by an expert. A copy
    lesson's: a tool whose result it can copy, the calculator when the problem has an expression.
    ``calls_only``: a tool call, never the answer. Experts in ``avoid`` (endpoints that cost money)
    are never called."""
    names, aliases = [t["function"]["name"] for t in tools], _aliases(tools, avoid)
    m = _EXPR_RE.match(task.problem)
    chain = "search" in names and aliases and MULTISTEP_RE.match(task.problem)
    kinds = (
        (["answer"] if aliases else [])
        + (["expert"] if "expert" in names and aliases else [])
        + (["calculator"] if "calculator" in names and m else [])
        + (["search"] if chain else [])
    )
    if copy:
        kinds = [k for k in ("calculator", "expert") if k in kinds][:1]
    elif calls_only:
        kinds = [k for k in kinds if k != "answer"]
    if not kinds:
        paid = f"; experts it does not call (endpoints; warm_start.endpoint_experts=true allows them): {sorted(avoid)}"
        raise ValueError(
            f"warm start: task {task.id!r} offers none of what the scripted warm start uses (the calculator "
            f"on 'What is a op b?', an expert, or answer written by an expert); its tools: {names}"
            + (paid if avoid else "")
        )
    kind = rng.choice(kinds)
    if kind == "search":
        return "search", {"model": rng.choice(aliases)}  # a chain's first call (chain_call)
    if kind == "calculator":
        return kind, {"expression": m.group(1)}
    if kind == "expert":
        return kind, {"model": rng.choice(aliases), "query": task.problem}
    return "answer", {"model": rng.choice(aliases)}


def chain_call(task: TaskRecord, observations: list[str], writer: str, finisher: str) -> tuple[str, dict]:
    """The next call of a multi-step task's chain after ``observations`` (the chain's results so far): a
    ``search`` whose query expert ``writer`` writes (the entities the question names, in its order), twice,
    then ``answer`` written by expert ``finisher`` from the two results."""
    if len(observations) < 2:
        return "search", {"model": writer}
    return "answer", {"model": finisher}


def _final(observation: str, tools: list[dict], rng: random.Random, avoid: frozenset = frozenset()) -> dict:
    """After a tool result: answer with what it said, or have an expert (not in ``avoid``) write it."""
    aliases = _aliases(tools, avoid)
    if not aliases or rng.random() < 0.5:
        return {"answer": answer_from(observation)}
    return {"model": rng.choice(aliases)}


def answer_from(observation: str) -> str:
    """The answer a tool result states: an expert's "...: The answer is X." or the whole result."""
    m = _ANSWER_RE.search(observation.strip())
    return (m.group(1) if m else observation).strip()


def paid_aliases(tools: list[dict]) -> frozenset:
    """The expert aliases of an episode that a real endpoint serves: every alias its tools offer that
    their descriptions do not mark "(simulated)" (the service's contract, tools_env/README.md)."""
    text = " ".join(t["function"].get("description", "") for t in tools)
    return frozenset(a for a in _aliases(tools) if f"{a} (simulated)" not in text)


async def scripted_episodes(
    tasks: list[TaskRecord], client, seed: int, copy: bool = False, paid_experts: bool = False, max_calls: int = 1
) -> list[ScriptedEpisode]:
    """One scripted episode per task; ``copy``: copy lessons (a tool, then its result as the answer).
    Without ``paid_experts`` no episode calls an expert a real endpoint serves (``paid_aliases``).
    ``max_calls`` > 1: after its first call an episode makes up to ``max_calls - 1`` more (each a random
    valid tool call, e.g. a second opinion), drawn uniformly, and answers from the last result."""
    rng = random.Random(seed)
    choices = [rng.random() for _ in tasks]

    async def one(task: TaskRecord, r: float) -> ScriptedEpisode:
        ep = await client.create_episode(task.to_dict())
        rng = random.Random(r)
        try:
            avoid = frozenset() if paid_experts else paid_aliases(ep["tools"])
            name, args = _choose(task, ep["tools"], rng, copy, avoid)
            result = await client.step(ep["episode_id"], name, args)
            turns = [(name, args, str(result["observation"]))]
            chained = name == "search"
            finisher = rng.choice(_aliases(ep["tools"], avoid)) if chained else ""
            while chained and name != "answer" and not result["done"]:  # a chain: to its end, answer included
                name, args = chain_call(task, [obs for _, _, obs in turns], turns[0][1]["model"], finisher)
                result = await client.step(ep["episode_id"], name, args)
                turns.append((name, args, str(result["observation"])))
            extra = rng.randrange(max_calls) if max_calls > 1 and not copy and name != "answer" else 0
            for _ in range(extra):
                if result["done"]:
                    break
                name, args = _choose(task, ep["tools"], rng, avoid=avoid, calls_only=True)
                result = await client.step(ep["episode_id"], name, args)
                turns.append((name, args, str(result["observation"])))
            if not result["done"]:
                final_args = (
                    {"answer": answer_from(turns[-1][2])} if copy else _final(turns[-1][2], ep["tools"], rng, avoid)
                )
                last = await client.step(ep["episode_id"], "answer", final_args)
                turns.append(("answer", final_args, str(last["observation"])))
            return ScriptedEpisode(task, ep["tools"], turns, copy=copy)
        finally:
            await client.delete_episode(ep["episode_id"])

    return await asyncio.gather(*[one(t, r) for t, r in zip(tasks, choices)])


def _plan(task: TaskRecord, name: str, args: dict) -> str:
    return plan_text(task.category, task.meta.get("preference_name"), name, args)


def render_text(ep: ScriptedEpisode, template: str, reward_cfg: RewardConfig) -> str:
    """The whole conversation as the chat template renders it (tokenizer training text)."""
    msgs = task_messages(with_default_preference(ep.task, reward_cfg.default_preference))
    for name, args, obs in ep.turns:
        msgs.append(tool_call_message(name, args, _plan(ep.task, name, args)))
        msgs.append({"role": "tool", "content": obs})
    return render_chat(template, msgs, ep.tools)


def to_trajectory(ep: ScriptedEpisode, chat: ChatFormat, reward_cfg: RewardConfig) -> Trajectory:
    """Token ids built exactly as a rollout builds them (``Transcript``): prompt, then (turn, observation)*,
    each turn written as the chat template writes its message (its plan, then the call). The prompt carries
    the episode's tool schemas, except a copy lesson's (short)."""
    messages = task_messages(with_default_preference(ep.task, reward_cfg.default_preference))
    tools = [] if ep.copy else ep.tools  # a copy lesson: short, without the tool schemas
    transcript = Transcript(chat, messages, tools)
    ids = chat.encode(transcript.text)
    traj = Trajectory(
        task=ep.task,
        group=0,
        token_ids=list(ids),
        loss_mask=[0] * len(ids),
        gen_logprobs=[0.0] * len(ids),
        prompt_len=len(ids),
    )
    for i, (name, args, obs) in enumerate(ep.turns):
        call_id = f"call_{i + 1}"
        if chat.reasoning_parser:  # the plan as reasoning, which the template writes as the server splits it
            inner = plan(ep.task.category, ep.task.meta.get("preference_name"), name, args)
            message = {**tool_call_message(name, args, "", call_id), "reasoning_content": inner}
        else:
            message = tool_call_message(name, args, _plan(ep.task, name, args), call_id)
        text = chat.turn_text(messages, message, tools)
        parsed = transcript.assistant(messages, chat.read_turn(text, call_id), text)
        if parsed.error is not None:
            raise ChatTemplateError(f"the chat template's own writing of a scripted turn is refused: {parsed.error}")
        messages.append(parsed.message)
        turn = chat.encode(text) + [chat.end_of_turn_id]
        untrained = chat.plan_length(text, turn) if ep.copy else 0  # a copy lesson trains the call, not the plan
        traj.turns.append(TurnRecord(start=len(traj.token_ids), calls=1))  # no action key: no per-turn credit
        traj.token_ids += turn
        traj.loss_mask += [0] * untrained + [1] * (len(turn) - untrained)
        if i + 1 < len(ep.turns):
            messages.append(tool_message(obs, call_id))
            suffix = chat.encode(transcript.observe(messages))
            traj.token_ids += suffix
            traj.loss_mask += [0] * len(suffix)
    traj.gen_logprobs = [0.0] * len(traj.token_ids)
    return traj
