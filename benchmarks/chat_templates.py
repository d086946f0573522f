"""What keeping trained = served costs, on long multi-turn episodes.

Started by ``python recipes/benchmark.py chat [--entries N] [--out FILE]``. BFCL ``multi_turn_base``
entries (the ``bfcl`` extra) are played through ``run_episodes`` by a token-level policy that writes
each entry's ground-truth calls as the chat template writes them, with Qwen3's published template as
the user's tokenizer's (``model.chat_template=auto`` adopts the prefix-preserving one, thinking on).
Reported: the probe's time at load; the agent loop's rendering and checking of each continuation
(``Transcript``) per turn; and the tokens an episode trains on as one sequence (what the loop keeps)
against per-turn re-rendering with each turn as its own sample (each turn's prompt, the conversation
so far, plus its generated tokens), the alternative design (docs/chat_templates.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import time
from typing import Any

from nemo_orchestra.data.default_tasks import generate_tasks
from nemo_orchestra.prompting import chat as chat_module
from nemo_orchestra.prompting.chat import PREFIX_QWEN3_TEMPLATE, render_chat, resolve_chat_format, tool_call_message
from nemo_orchestra.prompting.prompts import task_messages
from nemo_orchestra.prompting.tokenizer import build_embedded_tokenizer
from nemo_orchestra.rollout.loop import LoopLimits, Turn, run_episodes
from tools_env.client import ToolsEnvClient
from tools_env.supervisor import start_service

QWEN3_TEMPLATE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "chat_templates", "qwen3.jinja"
)


def add_args(parser: Any) -> None:
    parser.add_argument("--entries", type=int, default=60, help="BFCL multi_turn_base entries played")
    parser.add_argument("--out", default=None, help="write the JSON report here")


class GroundTruthWriter:
    """A token-level policy: each turn is the entry's next ground-truth call (then ``answer``), with a
    short reasoning, written as the chat template writes that message; records each turn's prompt length."""

    name = "ground-truth"

    def __init__(self, chat):
        self.chat, self.prompt_lengths = chat, {}

    async def act(self, episodes):
        turns = []
        for ep in episodes:
            self.prompt_lengths.setdefault(ep.episode_id, []).append(len(ep.traj.token_ids))
            actions = ep.task.gold_actions
            a = actions[ep.turn] if ep.turn < len(actions) else {"name": "answer", "arguments": {"answer": "done"}}
            message = {**tool_call_message(a["name"], dict(a.get("arguments", {}))), "reasoning_content": "Next."}
            text = self.chat.turn_text(ep.messages, message, ep.tools)
            ids = self.chat.encode(text) + [self.chat.end_of_turn_id]
            turns.append(Turn(text, ids, [0.0] * len(ids), True, prompt_tokens=1, completion_tokens=len(ids)))
        return turns

    async def aclose(self) -> None:
        pass


def main(args) -> int:
    try:
        from tools_env.domains.bfcl.importer import read_category, to_record
    except ImportError as e:
        print(f"benchmark.py chat: needs the 'bfcl' extra ({e})")
        return 2
    corpus = [render_chat(PREFIX_QWEN3_TEMPLATE, task_messages(t)) for t in generate_tasks(100, 3)]
    tokenizer = build_embedded_tokenizer(corpus)
    with open(QWEN3_TEMPLATE) as f:
        tokenizer.chat_template = f.read()
    t0 = time.perf_counter()
    chat = resolve_chat_format(tokenizer, "auto", True)
    probe_s = time.perf_counter() - t0
    records = [to_record(e, gt, "multi_turn_base") for e, gt in read_category("multi_turn_base")[: args.entries]]

    spent = [0.0]  # the loop's Transcript work: rendering and checking each continuation
    originals = {name: getattr(chat_module.Transcript, name) for name in ("assistant", "observe")}

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t

        return wrapper

    writer = GroundTruthWriter(chat)
    for name, fn in originals.items():
        setattr(chat_module.Transcript, name, timed(fn))
    try:
        with start_service({}) as service:

            async def play():
                client = ToolsEnvClient(service.urls)
                try:
                    limits = LoopLimits(max_turns=100)
                    return await run_episodes(records, writer, client, limits=limits, default_preference={})
                finally:
                    await client.aclose()

            t0 = time.perf_counter()
            trajs = asyncio.run(play())
            wall_s = time.perf_counter() - t0
    finally:
        for name, fn in originals.items():
            setattr(chat_module.Transcript, name, fn)

    episodes = [ep for ep in writer.prompt_lengths.values()]
    one = [len(t.token_ids) for t in trajs]
    per_turn = [sum(p) + sum(t.loss_mask) for p, t in zip(episodes, trajs)]
    turns = sum(len(t.turns) for t in trajs)
    report = {
        "benchmark": "chat",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor()},
        "entries": len(trajs),
        "correct": sum(t.correct for t in trajs),
        "format_errors": sum(t.format_errors for t in trajs),
        "turns_mean": turns / len(trajs),
        "turns_max": max(len(t.turns) for t in trajs),
        "probe_s": probe_s,
        "transcript_ms_per_turn": 1000 * spent[0] / turns,
        "wall_s": wall_s,
        "tokens_one_sequence_mean": statistics.fmean(one),
        "tokens_per_turn_samples_mean": statistics.fmean(per_turn),
        "per_turn_over_one_mean": statistics.fmean(p / o for p, o in zip(per_turn, one)),
        "per_turn_over_one_max": max(p / o for p, o in zip(per_turn, one)),
    }
    print(
        f"{report['entries']} BFCL entries ({report['correct']} passed, {report['format_errors']} format errors), "
        f"{report['turns_mean']:.1f} turns an episode (max {report['turns_max']})\n"
        f"probe at load: {probe_s:.3f} s; continuation rendering and check: {report['transcript_ms_per_turn']:.2f} ms/turn\n"
        f"tokens an episode: {report['tokens_one_sequence_mean']:.0f} as one sequence, "
        f"{report['tokens_per_turn_samples_mean']:.0f} as per-turn samples "
        f"({report['per_turn_over_one_mean']:.1f}x mean, {report['per_turn_over_one_max']:.1f}x max)"
    )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    return 0 if report["format_errors"] == 0 and report["correct"] == report["entries"] else 1
