"""A tiny OpenAI-compatible ``/v1/chat/completions`` server for tests, run as a subprocess.

    python tests/doubles/expert_chat_server.py --port 0 --ready-file PATH

Behaviour by the request's ``model``:
- ``echo``: answers ``"echo: <last user message>"``, usage 11 prompt / 7 completion tokens.
- ``nousage``: like echo without a ``usage`` block.
- ``slowecho``: like echo, answered after ``SLOW_S`` seconds.
- ``flaky``: 503 for the first two requests this process sees with this model, then echo.
- ``hang``: never answers.
- ``bad``: 400 (a non-retryable refusal).
- ``judge``: reads the "Gold answer:" line and the quoted answer between <predicted_answer> tags
  (tools_env/tools/answer.py's prompt) and answers ``VERDICT: CORRECT`` when the gold answer
  occurs in the prediction ignoring case, else ``VERDICT: INCORRECT``.
``GET /stats`` returns request counts by model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
from collections import Counter

from aiohttp import web

COUNTS: Counter = Counter()
SLOW_S = 0.2  # how long ``slowecho`` takes to answer


def completion(content: str, usage: bool = True) -> web.Response:
    body = {
        "id": "cmpl-test",
        "object": "chat.completion",
        "model": "fake",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
    }
    if usage:
        body["usage"] = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
    return web.json_response(body)


async def chat(request: web.Request) -> web.StreamResponse:
    data = await request.json()
    model = data.get("model")
    COUNTS[model] += 1
    last = data["messages"][-1]["content"]
    if model == "echo":
        return completion(f"echo: {last}")
    if model == "slowecho":
        await asyncio.sleep(SLOW_S)
        return completion(f"echo: {last}")
    if model == "nousage":
        return completion(f"echo: {last}", usage=False)
    if model == "flaky":
        if COUNTS[model] <= 2:
            return web.json_response({"error": "overloaded"}, status=503)
        return completion(f"echo: {last}")
    if model == "hang":
        await asyncio.sleep(3600)
    if model == "judge":
        gold = re.search(r"^Gold answer: (.*)$", last, re.M).group(1).strip().lower()
        pred = json.loads(re.search(r"^<predicted_answer>\n(.*)$", last, re.M).group(1)).strip().lower()
        return completion("VERDICT: CORRECT" if gold in pred else "VERDICT: INCORRECT")
    return web.json_response({"error": {"message": f"unknown model {model}"}}, status=400)


async def stats(request: web.Request) -> web.Response:
    return web.json_response(dict(COUNTS))


async def main(port: int, ready_file: str) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/stats", stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    tmp = ready_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"url": f"http://127.0.0.1:{runner.addresses[0][1]}"}, f)
    os.replace(tmp, ready_file)
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-file", required=True)
    args = p.parse_args()
    asyncio.run(main(args.port, args.ready_file))
