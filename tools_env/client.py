"""The trainer's client of the tool service: one pooled aiohttp session, episodes sharded by id.

    client = ToolsEnvClient(handle.urls, token=handle.token)
    ep = await client.create_episode(task.to_dict())           # {"episode_id", "tools"}
    results = await asyncio.gather(*(client.step(i, "calculator", {"expression": "1+1"}) for i in ids))
    await client.aclose()

Sharding: the client picks each new episode's id (32 hex digits) and asks the replica at
``crc32(id) % len(urls)`` to create it (``POST /v1/episodes?episode_id=...``); every later call
for that id goes to the same replica. Routing is stateless, so any client with the same URL
list reaches any episode. (Episodes created without an id, e.g. with curl, get a server-made id
``w<k>-...`` naming the worker that holds them; crc32 routing does not apply to those.) Calls
are never retried here: a
step that reached the service may have run (and cost money). Every failure, HTTP 4xx/5xx or
transport, raises ``ToolsEnvError`` carrying the server's code and message; what a training run
does about a service that is gone is ``tools_env.recovery``'s business (restart and retry the
whole batch of episodes, or stop).
"""

from __future__ import annotations

import asyncio
import uuid
import zlib
from typing import Any
from urllib.parse import quote

import aiohttp

try:
    import orjson

    _dumps, _loads = orjson.dumps, orjson.loads
except ImportError:  # pragma: no cover - the plain-json fallback
    import json

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj).encode()

    _loads = json.loads


class ToolsEnvError(RuntimeError):
    """A failed call to the tool service: ``status`` (0 for transport errors), ``code``, ``message``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"tools_env {status or 'transport'} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class ToolsEnvClient:
    def __init__(
        self,
        urls: list[str] | str,
        token: str | None = None,
        timeout_s: float = 60.0,
        max_connections: int = 1024,
        service: Any = None,
    ) -> None:
        self.urls: list[str] = []
        self.retarget(urls)
        self.service = service  # the ServiceHandle this process started and may restart (tools_env.recovery)
        self.token = token
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_connections = max_connections
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._session: aiohttp.ClientSession | None = None

    def retarget(self, urls: list[str] | str) -> None:
        """Send every later call to these replicas (a restarted service's URLs)."""
        urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not urls:
            raise ValueError("ToolsEnvClient needs at least one service URL")
        self.urls = urls

    def url_for(self, episode_id: str) -> str:
        return self.urls[zlib.crc32(episode_id.encode()) % len(self.urls)]

    async def _request(self, method: str, url: str, body: Any = None) -> Any:
        if self._session is None or self._session.closed:
            # limit covers all replicas; keep-alive shorter than the server's 75 s so a pooled
            # connection is never reused just as the server closes it
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, keepalive_timeout=30)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        data = None if body is None else _dumps(body)
        try:
            async with self._session.request(method, url, data=data, headers=self._headers) as resp:
                raw = await resp.read()
                status = resp.status
        except asyncio.TimeoutError:
            raise ToolsEnvError(0, "timeout", f"{method} {url}: no response within {self.timeout.total}s") from None
        except aiohttp.ClientError as e:
            raise ToolsEnvError(0, "connection_error", f"{method} {url}: {type(e).__name__}: {e}") from None
        try:
            payload = _loads(raw) if raw else None
        except ValueError:
            payload = None
        if status >= 400:
            err = payload.get("error") if isinstance(payload, dict) else None
            if isinstance(err, dict):
                raise ToolsEnvError(status, str(err.get("code")), str(err.get("message")))
            raise ToolsEnvError(status, "http_error", raw[:300].decode(errors="replace"))
        if payload is None and method != "DELETE":
            raise ToolsEnvError(status, "bad_response", f"{method} {url}: response is not JSON")
        return payload

    async def create_episode(self, task: dict[str, Any], episode_id: str | None = None) -> dict[str, Any]:
        """``{"episode_id", "tools"}``; the id is chosen here unless given."""
        episode_id = episode_id or uuid.uuid4().hex
        url = f"{self.url_for(episode_id)}/v1/episodes?episode_id={quote(episode_id, safe='')}"
        return await self._request("POST", url, task)

    async def step(self, episode_id: str, name: str, arguments: Any) -> dict[str, Any]:
        """``{"observation", "cost", "latency_s", "done", "error"[, "outcome"]}``."""
        body = {"name": name, "arguments": arguments}
        return await self._request("POST", f"{self.url_for(episode_id)}/v1/episodes/{episode_id}/step", body)

    async def get_episode(self, episode_id: str) -> dict[str, Any]:
        return await self._request("GET", f"{self.url_for(episode_id)}/v1/episodes/{episode_id}")

    async def delete_episode(self, episode_id: str) -> dict[str, Any]:
        return await self._request("DELETE", f"{self.url_for(episode_id)}/v1/episodes/{episode_id}")

    async def tools(self) -> list[dict[str, Any]]:
        return (await self._request("GET", f"{self.urls[0]}/v1/tools"))["tools"]

    async def health(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self._request("GET", f"{u}/healthz") for u in self.urls)))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "ToolsEnvClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
