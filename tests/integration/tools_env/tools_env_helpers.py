"""Helpers for the tool-service tests (a unique module name: tests folders are not packages)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any


def qa_task(tools: list[str], answer: str = "42", category: str = "arithmetic", **extra: Any) -> dict[str, Any]:
    return {
        "problem": f"What is 6 * 7? ({extra.pop('tag', '')})",
        "answer": answer,
        "category": category,
        "tools": tools,
        **extra,
    }


def http(
    url: str,
    method: str = "GET",
    body: Any = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10,
) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, payload = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode(errors="replace")


def run(coro: Any) -> Any:
    return asyncio.run(coro)
