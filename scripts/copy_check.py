"""How well a run's policy copies: teacher-forced, on copy lessons of tasks it never saw, in two prompts.

    python scripts/copy_check.py runs/grpo_orchestrator [--tasks 200] [--seed 777]

Cost-sensitive arithmetic of the default task set (``generate_tasks(..., seed)``), each scripted as a copy
lesson: the calculator on the problem's expression, then its result as the answer. Each lesson is fed to the
exported checkpoint (``RUN/hf`` or an export folder) with its calls teacher-forced, and a call counts as copied
when the model's most likely next token is the lesson's at every token of it (the calculator call copies the
expression from the problem, the answer call the result from the tool). Printed for the lesson's own short
prompt (no tool schemas: how the warm start and, by default, GRPO write copy lessons) and for the prompt a
rollout of the same task sees (the tool schemas in it: where the policy copies), with the first wrong token of
the answer calls (wanted, predicted) most often seen. A copy that holds in the first and not in the second is
held by lessons written without the schemas only where they are written (``loss.lesson_schemas``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call_spans(mask: list[int]) -> list[tuple[int, int]]:
    """The [start, end) runs of trained tokens in a copy lesson's loss mask: one per call, in order."""
    spans, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def copied_calls(predicted: list[int], ids: list[int], mask: list[int]) -> list[int | None]:
    """Per call span of a lesson: None when every token of it is the one predicted (``predicted[j - 1]``, the
    most likely token after ``ids[:j]``), else the position of its first token that is not."""
    out = []
    for a, b in call_spans(mask):
        wrong = [j for j in range(a, b) if predicted[j - 1] != ids[j]]
        out.append(wrong[0] if wrong else None)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a run folder (its hf/ export) or a Hugging Face export folder")
    p.add_argument("--tasks", type=int, default=200, help="cost-sensitive arithmetic tasks (default 200)")
    p.add_argument("--seed", type=int, default=777, help="the task set's seed (default 777: no run draws it)")
    args = p.parse_args(argv)
    if args.tasks < 1:
        p.error("--tasks must be 1 or more")
    sys.path.insert(0, ROOT)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_orchestra.config import load_config
    from nemo_orchestra.data.default_tasks import generate_tasks
    from nemo_orchestra.data.warm_start import scripted_episodes, to_trajectory
    from nemo_orchestra.evaluation.checkpoint_policy import resolve_export, run_settings
    from nemo_orchestra.prompting.chat import ChatFormat
    from tools_env.client import ToolsEnvClient
    from tools_env.supervisor import start_service

    try:
        folder = resolve_export(args.checkpoint)
    except FileNotFoundError as e:
        print(f"copy_check: {e}", file=sys.stderr)
        return 2
    settings = run_settings(args.checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    chat = ChatFormat(
        tokenizer,
        None,
        settings.enable_thinking if settings else None,
        settings.reasoning_parser if settings else False,
    )
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    reward = load_config([]).reward
    pool = generate_tasks(12 * args.tasks, args.seed)
    tasks = [t for t in pool if t.category == "arithmetic" and t.meta.get("preference_name") == "cost_sensitive"]
    tasks = tasks[: args.tasks]

    service = start_service({})
    try:
        client = ToolsEnvClient(service.urls, token=service.token)

        async def episodes():
            try:
                return await scripted_episodes(tasks, client, seed=args.seed, copy=True)
            finally:
                await client.aclose()

        lessons = [ep for ep in asyncio.run(episodes()) if ep.turns[0][0] == "calculator"]
    finally:
        service.stop()
    if not lessons:
        print(f"copy_check: no calculator lesson among {len(tasks)} tasks of seed {args.seed}", file=sys.stderr)
        return 2

    print(f"{folder}: {len(lessons)} cost-sensitive arithmetic copy lessons, teacher-forced")
    for schemas, label in ((False, "lesson prompt (no tool schemas)"), (True, "rollout prompt (tool schemas)")):
        right = [0, 0]
        first_wrong = collections.Counter()
        for ep in lessons:
            t = to_trajectory(ep, chat, reward, schemas=schemas)
            with torch.no_grad():
                predicted = model(torch.tensor([t.token_ids])).logits[0].argmax(-1).tolist()
            expression, answer = copied_calls(predicted, t.token_ids, t.loss_mask)
            right[0] += expression is None
            right[1] += answer is None
            if answer is not None:
                first_wrong[(chat.decode([t.token_ids[answer]]), chat.decode([predicted[answer - 1]]))] += 1
        n = len(lessons)
        common = ", ".join(f"{w!r} as {p!r} x{k}" for (w, p), k in first_wrong.most_common(4))
        print(
            f"  {label}: expression copied {right[0]}/{n} ({right[0] / n:.3f}), "
            f"result copied {right[1]}/{n} ({right[1] / n:.3f})" + (f"; first wrong: {common}" if common else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
