"""A tiny fake OpenAI-compatible chat server for offline tests and demos of the LLM-driven paths.

    python tests/doubles/oracle_chat_server.py --oracle ORACLE.jsonl [--port 0] [--ready-file PATH]

``ORACLE.jsonl`` lines are ``{"key": text, "answer": str, "gold_actions": [...]}``; a request is
matched to the entry whose ``key`` is the longest one contained in its first user message.

- Reword requests (system prompt starting "You reword"): the reply is the text with a prefix.
- Anything else is a policy turn. Each task has a fixed skill level drawn from a hash of its
  key: never solved, always solved, or solved when ``hash(key, seed) `` is even (``seed`` from
  the request). A solving turn replays the gold actions one per assistant turn, then answers;
  a failing one answers "I am not sure". Calls alternate between the OpenAI ``tool_calls`` field
  and ``<tool_call>`` text, so both parsers are exercised. Usage is reported.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys

from aiohttp import web


def _h(*parts: object) -> int:
    return int(hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:12], 16)


def skill(key: str, seed: int) -> bool:
    """Whether the fake model solves this task with this seed."""
    level = _h(key) % 4
    return level == 1 or (level >= 2 and _h(key, seed) % 2 == 0)


class FakeModel:
    def __init__(self, oracle: list[dict]) -> None:
        self.oracle = sorted(oracle, key=lambda e: -len(e["key"]))

    def match(self, text: str) -> dict | None:
        return next((e for e in self.oracle if e["key"] in text), None)

    def reply(self, body: dict) -> dict:
        messages = body.get("messages", [])
        system = next((m["content"] for m in messages if m["role"] == "system"), "")
        user = next((m["content"] for m in messages if m["role"] == "user"), "")
        if system.startswith("You reword"):
            return {"role": "assistant", "content": f"Please help with this: {user}"}
        entry = self.match(user)
        turn = sum(1 for m in messages if m["role"] == "assistant")
        if entry is None or not skill(entry["key"], int(body.get("seed") or 0)):
            name, args = "answer", {"answer": "I am not sure"}
        elif turn < len(entry["gold_actions"]):
            name, args = entry["gold_actions"][turn]["name"], entry["gold_actions"][turn]["arguments"]
        else:
            name, args = "answer", {"answer": entry["answer"] or "done"}
        if body.get("tools") and turn % 2 == 0:
            call = {"id": f"call_{turn}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            return {"role": "assistant", "content": "", "tool_calls": [call]}
        text = "<think>routing</think>\n<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
        return {"role": "assistant", "content": text}


def make_app(model: FakeModel) -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        message = model.reply(body)
        prompt_tokens = len(json.dumps(body.get("messages", []))) // 4
        return web.json_response(
            {
                "id": "fake",
                "object": "chat.completion",
                "model": body.get("model", "fake"),
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 20, "total_tokens": prompt_tokens + 20},
            }
        )

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--oracle", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ready-file")
    args = ap.parse_args(argv)
    with open(args.oracle) as f:
        oracle = [json.loads(line) for line in f if line.strip()]
    sock = socket.socket()
    sock.bind(("127.0.0.1", args.port))
    sock.listen(128)  # connections queue from here on, before the app starts accepting
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    if args.ready_file:
        with open(args.ready_file + ".tmp", "w") as f:
            f.write(url)
        os.replace(args.ready_file + ".tmp", args.ready_file)
    print(f"READY {url}", flush=True)
    web.run_app(make_app(FakeModel(oracle)), sock=sock, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
