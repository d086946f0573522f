"""Load test of the tool service: tool calls/s and p50/p99 step latency at 1, 64 and 512 episodes.

Started by ``python recipes/benchmark.py tools_env [--out FILE]``. The service runs as its own
subprocess(es) (``start_service``); the load generator is this process: one keep-alive HTTP/1.1
connection per episode, written with a bare ``asyncio.Protocol`` (and uvloop when installed) so
that the generator, which shares the machine's cores with the service, costs as little as
possible. Each episode calls its tool back to back (closed loop: ``saturate``), which measures
throughput, and latency there is queueing (Little's law: latency = episodes / throughput).
``paced`` runs 512 episodes with a fixed total offer of calls/s (open loop, each call timed from
its scheduled start, so a slow server cannot hide its queue) — the trainer's case, where
policies think between calls. One ``client`` row repeats the 512-episode run through
``ToolsEnvClient`` (aiohttp) to show what the trainer's client costs. The calculator cases run
once per service worker count (``--workers 1,2``); ``python`` once, since the sandbox bounds it,
per sandbox path in ``--python-paths`` (``warm``: forked from the zygote, the default; ``cold``:
fresh interpreters per call), each in a service of its own.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from tools_env.client import ToolsEnvClient
from tools_env.supervisor import start_service

TOOL_CALLS = {
    "calculator": {"expression": "(12345 * 6789 + 42) / 7"},
    "python": {"code": "print(sum(range(1000)))"},
}


@dataclass
class Row:
    tool: str
    mode: str  # saturate | paced | client
    episodes: int
    calls: int
    seconds: float
    calls_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    workers: int = 1
    sandbox: str = ""  # python rows: the sandbox path, warm or cold


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; responses must carry Content-Length (aiohttp's do)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        head = bytes(self.buf[:end]).lower()
        length, i = 0, head.find(b"content-length:")
        if i >= 0:
            j = head.find(b"\r\n", i)
            length = int(head[i + 15 : j if j > 0 else None])
        if len(self.buf) < end + 4 + length:
            return
        status = int(head[9:12])
        body = bytes(self.buf[end + 4 : end + 4 + length])
        del self.buf[: end + 4 + length]
        waiter, self.waiter = self.waiter, None
        waiter.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.waiter


def _step_request(url: str, episode_id: str, body: bytes, token: str | None) -> bytes:
    host = urlsplit(url).netloc
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST /v1/episodes/{episode_id}/step HTTP/1.1\r\nHost: {host}\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _open(url: str) -> _Conn:
    parts = urlsplit(url)
    _, conn = await asyncio.get_running_loop().create_connection(_Conn, parts.hostname, parts.port)
    return conn


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def _episodes(client: ToolsEnvClient, tool: str, n: int) -> list[str]:
    task = {"problem": "benchmark", "answer": "0", "category": "arithmetic", "tools": [tool, "answer"]}
    created = await asyncio.gather(*(client.create_episode(task) for _ in range(n)))
    return [c["episode_id"] for c in created]


async def run_case(
    client: ToolsEnvClient, tool: str, episodes: int, seconds: float, warmup_s: float, rate: float | None = None
) -> Row:
    """Closed loop (``rate=None``) or paced at ``rate`` total calls/s over ``episodes`` connections."""
    ids = await _episodes(client, tool, episodes)
    body = json.dumps({"name": tool, "arguments": TOOL_CALLS[tool]}).encode()
    conns = await asyncio.gather(*(_open(client.url_for(i)) for i in ids))
    reqs = [_step_request(client.url_for(i), i, body, client.token) for i in ids]
    latencies: list[float] = []
    errors = 0
    clock = time.perf_counter  # uvloop's loop.time() ticks in whole milliseconds
    start = clock()
    measure_from, stop_at = start + warmup_s, start + warmup_s + seconds

    async def drive(conn: _Conn, raw: bytes) -> None:
        nonlocal errors
        period = episodes / rate if rate else 0.0
        next_at = clock() + random.random() * period
        while True:
            if rate:
                delay = next_at - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
            t0 = next_at if rate else clock()
            if t0 >= stop_at:
                return
            status, resp = await conn.request(raw)
            t1 = clock()
            if t0 >= measure_from:
                latencies.append(t1 - t0)
                if status != 200 or b'"error":null' not in resp:
                    errors += 1
            next_at += period

    await asyncio.gather(*(drive(c, r) for c, r in zip(conns, reqs)))
    for c in conns:
        c.transport.close()
    await asyncio.gather(*(client.delete_episode(i) for i in ids))
    latencies.sort()
    return Row(
        tool,
        "paced" if rate else "saturate",
        episodes,
        len(latencies),
        seconds,
        len(latencies) / seconds,
        1e3 * _percentile(latencies, 0.50),
        1e3 * _percentile(latencies, 0.99),
        errors,
    )


async def run_client_case(client: ToolsEnvClient, tool: str, episodes: int, seconds: float, warmup_s: float) -> Row:
    """The same closed loop through ``ToolsEnvClient.step`` (the trainer's path)."""
    ids = await _episodes(client, tool, episodes)
    latencies: list[float] = []
    errors = 0
    clock = time.perf_counter
    measure_from = clock() + warmup_s
    stop_at = measure_from + seconds

    async def drive(eid: str) -> None:
        nonlocal errors
        while (t0 := clock()) < stop_at:
            result = await client.step(eid, tool, TOOL_CALLS[tool])
            if t0 >= measure_from:
                latencies.append(clock() - t0)
                errors += result["error"] is not None

    await asyncio.gather(*(drive(i) for i in ids))
    await asyncio.gather(*(client.delete_episode(i) for i in ids))
    latencies.sort()
    return Row(
        tool,
        "client",
        episodes,
        len(latencies),
        seconds,
        len(latencies) / seconds,
        1e3 * _percentile(latencies, 0.50),
        1e3 * _percentile(latencies, 0.99),
        errors,
    )


async def _bench(
    urls: list[str],
    tools: list[str],
    concurrency: list[int],
    seconds: float,
    paced_rate: float,
    warmup_s: float,
    workers: int,
    sandbox: str = "",
) -> list[Row]:
    rows = []
    client = ToolsEnvClient(urls)

    async def record(row_coro: Any) -> None:
        row = await row_coro
        row.workers = workers
        row.sandbox = sandbox if row.tool == "python" else ""
        rows.append(row)
        _print_row(row)

    try:
        for tool in tools:
            for n in concurrency:
                await record(run_case(client, tool, n, seconds, warmup_s))
            if tool == "calculator":
                await record(run_case(client, tool, max(concurrency), seconds, warmup_s, rate=paced_rate))
                await record(run_client_case(client, tool, max(concurrency), seconds, warmup_s))
    finally:
        await client.aclose()
    return rows


_HEADER = (
    f"{'tool':<16} {'mode':<9} {'workers':>7} {'episodes':>8} {'calls':>8} {'calls/s':>9} {'p50 ms':>8} "
    f"{'p99 ms':>8} {'errors':>6}"
)


def _print_row(r: Row) -> None:
    tool = f"{r.tool} ({r.sandbox})" if r.sandbox else r.tool
    print(
        f"{tool:<16} {r.mode:<9} {r.workers:>7} {r.episodes:>8} {r.calls:>8} {r.calls_per_s:>9.0f} "
        f"{r.p50_ms:>8.2f} {r.p99_ms:>8.2f} {r.errors:>6}",
        flush=True,
    )


def run(
    out: str | None = None,
    *,
    workers: tuple[int, ...] = (1, 2),
    seconds: float = 4.0,
    concurrency: tuple[int, ...] = (1, 64, 512),
    paced_rate: float = 2000.0,
    tools: tuple[str, ...] = ("calculator", "python"),
    warmup_s: float = 1.0,
    python_paths: tuple[str, ...] = ("warm",),
) -> dict[str, Any]:
    """Start the service for each worker count, run every case, print the table and write the JSON
    report to ``out``. ``python`` runs only with the first worker count (the sandbox, not the
    service, bounds it), once per sandbox path in ``python_paths`` (warm, cold)."""
    for path in python_paths:
        if path not in ("warm", "cold"):
            raise ValueError(f"unknown sandbox path {path!r}; valid: warm, cold")
    notes = []
    tools = list(tools)
    if "python" in tools and importlib.util.find_spec("tools_env.sandbox") is None:
        tools.remove("python")
        notes.append("python skipped: tools_env.sandbox is not importable")
    config = {"guards": {"max_turns": 10**9, "max_cost": 1e9, "max_wall_s": 1e6, "ttl_s": 3600}}
    try:
        import uvloop

        runner = uvloop.run
        loop_name = "uvloop"
    except ImportError:
        runner, loop_name = asyncio.run, "asyncio"
    load_before = os.getloadavg()[0]
    print(_HEADER)
    rows: list[Row] = []
    for k, n_workers in enumerate(workers):
        these = [t for t in tools if t != "python"]
        if these:
            with start_service(config, workers=n_workers) as svc:
                rows += runner(_bench(svc.urls, these, list(concurrency), seconds, paced_rate, warmup_s, n_workers))
        for path in python_paths if k == 0 and "python" in tools else ():
            with start_service({**config, "python": {"warm": path == "warm"}}, workers=n_workers) as svc:
                rows += runner(
                    _bench(svc.urls, ["python"], list(concurrency), seconds, paced_rate, warmup_s, n_workers, path)
                )
    notes.append(
        f"1-minute load average before: {load_before:.2f}, after: {os.getloadavg()[0]:.2f} "
        "(other processes on the machine skew the figures)"
    )
    for n in notes:
        print(f"note: {n}")
    report = {
        "benchmark": "tools_env",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "generator_loop": loop_name,
        },
        "seconds_per_case": seconds,
        "paced_rate": paced_rate,
        "notes": notes,
        "results": [asdict(r) for r in rows],
    }
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {out}")
    return report


def add_args(parser: Any) -> None:
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts to compare")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per case")
    parser.add_argument("--paced-rate", type=float, default=2000.0, help="total calls/s offered in the paced case")
    parser.add_argument("--tools", default="calculator,python", help="comma-separated: calculator, python")
    parser.add_argument("--python-paths", default="warm", help="comma-separated sandbox paths for python: warm, cold")


def main(args: Any) -> int:
    run(
        args.out,
        workers=tuple(int(w) for w in args.workers.split(",")),
        seconds=args.seconds,
        paced_rate=args.paced_rate,
        tools=tuple(t for t in args.tools.split(",") if t),
        python_paths=tuple(p for p in args.python_paths.split(",") if p),
    )
    return 0
