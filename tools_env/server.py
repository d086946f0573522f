"""The tool-environment HTTP service (aiohttp). See tools_env/README.md for the API and
``GET /openapi.json`` (``tools_env/openapi.py``) for its contract.

    python -m tools_env.server --host 127.0.0.1 --port 8700 [--config FILE.yaml|json]
                               [--workers N] [--token T] [--ready-file PATH] [--exit-with-parent]

Binds 127.0.0.1 unless told otherwise; any other address needs a bearer token (``--token`` or
``TOOLS_ENV_TOKEN``). ``--workers N`` runs N independent worker processes on ports
port..port+N-1 (or N free ports with ``--port 0``); clients shard episodes across the URLs.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import hmac
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
from typing import Any

from aiohttp import web

from tools_env import domains as _domains  # noqa: F401  (registers the db_state verifier)
from tools_env import tools as _plugins  # noqa: F401  (registers the tool plug-ins)
from tools_env.service_config import ServiceConfig
from tools_env.process import parent_gone, remove_if_orphaned, write_ready_file
from tools_env.episodes import EpisodeStore, ServiceError
from tools_env.prometheus import Metrics
from tools_env.openapi import NO_AUTH_PATHS, openapi_document
from tools_env.schema import STEP_REQUEST, check
from tools_env.domains.tau2.package import available as tau2_available
from tools_env.tools.base import TOOL_REGISTRY, Tool

try:
    import orjson

    dumps, loads = orjson.dumps, orjson.loads
except ImportError:  # pragma: no cover - the plain-json fallback

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    loads = json.loads

log = logging.getLogger("tools_env.server")

STORE = web.AppKey("store", EpisodeStore)
METRICS = web.AppKey("metrics", Metrics)
TOOLS = web.AppKey("tools", dict)
OPENAPI = web.AppKey("openapi", bytes)


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(data), status=status, content_type="application/json")


def error_response(status: int, code: str, message: str, metrics: Metrics | None = None) -> web.Response:
    if metrics is not None:
        metrics.http_errors[code] += 1
    return json_response({"error": {"code": code, "message": message}}, status)


async def read_json(request: web.Request) -> Any:
    body = await request.read()  # raises 413 beyond client_max_size
    try:
        return loads(body)
    except (ValueError, RecursionError) as e:
        raise ServiceError(400, "bad_json", f"request body is not valid JSON: {e}") from None


# ---- handlers ------------------------------------------------------------------------------


async def create_episode(request: web.Request) -> web.Response:
    record = await read_json(request)
    ep, schemas = request.app[STORE].create(record, request.query.get("episode_id"))
    return json_response({"episode_id": ep.id, "tools": schemas})


async def step(request: web.Request) -> web.Response:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ServiceError(400, "bad_request", 'step body must be a JSON object {"name": ..., "arguments": {...}}')
    error = check(body, STEP_REQUEST, "step body")
    if error:
        raise ServiceError(400, "bad_request", error)
    result = await request.app[STORE].step(
        request.match_info["episode_id"], body.get("name"), body.get("arguments", {})
    )
    return json_response(result)


async def get_episode(request: web.Request) -> web.Response:
    return json_response(request.app[STORE].lookup(request.match_info["episode_id"]))


async def delete_episode(request: web.Request) -> web.Response:
    summary = await request.app[STORE].delete(request.match_info["episode_id"])
    return json_response({**summary, "deleted": True})


async def list_tools(request: web.Request) -> web.Response:
    return json_response({"tools": [tool.schema(None) for tool in request.app[TOOLS].values()]})


async def healthz(request: web.Request) -> web.Response:
    store = request.app[STORE]
    return json_response({"status": "ok", "worker": store.worker_index, "episodes": len(store.episodes)})


async def metrics(request: web.Request) -> web.Response:
    store = request.app[STORE]
    active = sum(1 for ep in store.episodes.values() if ep.status == "active")
    text = request.app[METRICS].render({"episodes_active": active, "episodes_held": len(store.episodes)})
    return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI], content_type="application/json")


# ---- errors and auth -----------------------------------------------------------------------

_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def make_middleware(token: str | None, metrics: Metrics, max_request_bytes: int):
    expected = f"Bearer {token}".encode() if token else None

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if expected is not None and request.path not in NO_AUTH_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                resp = error_response(401, "unauthorized", "missing or wrong bearer token", metrics)
                resp.headers["WWW-Authenticate"] = "Bearer"
                return resp
        try:
            return await handler(request)
        except ServiceError as e:
            return error_response(e.status, e.code, e.message, metrics)
        except web.HTTPException as e:  # router 404/405, 413 from read(), ...
            if e.status < 400:
                raise
            code = _HTTP_CODES.get(e.status, "http_error")
            message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
            if e.status == 413:
                message = f"request body larger than {max_request_bytes} bytes"
            resp = error_response(e.status, code, f"{message} ({request.method} {request.path[:200]})", metrics)
            if isinstance(e, web.HTTPMethodNotAllowed):  # RFC 9110: a 405 lists the methods the route has
                resp.headers["Allow"] = ", ".join(sorted(e.allowed_methods))
            return resp
        except Exception as e:  # last resort: a structured 500 rather than a dropped connection
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(500, "internal", f"{type(e).__name__}: {e}", metrics)

    return middleware


# ---- app -----------------------------------------------------------------------------------


def check_tool_sections(cfg: ServiceConfig) -> None:
    unknown = sorted(set(cfg.tools) - set(TOOL_REGISTRY))
    if unknown:
        raise ValueError(f"config 'tools' names unknown tool(s) {unknown}; registered: {sorted(TOOL_REGISTRY)}")


def build_tools(cfg: ServiceConfig) -> dict[str, Tool]:
    """One instance of every registered tool; ours get typed config, others their `tools.<name>` section."""
    typed = {
        "expert": {"experts": cfg.experts, "seed": cfg.seed},
        "python": {"python": cfg.python},
        "answer": {"judge": cfg.judge, "experts": cfg.experts, "seed": cfg.seed, "user": cfg.user},
        "search": {**cfg.tools.get("search", {}), "experts": cfg.experts, "seed": cfg.seed},
    }
    if cfg.user is not None and tau2_available()[0]:  # conversational tasks: tau2's domain tools
        from tools_env.domains.tau2.tools import register_all

        register_all()
    check_tool_sections(cfg)
    return {name: cls(typed.get(name, cfg.tools.get(name, {}))) for name, cls in TOOL_REGISTRY.items()}


def build_app(cfg: ServiceConfig, *, token: str | None = None, worker_index: int = 0) -> web.Application:
    metrics_ = Metrics()
    tools = build_tools(cfg)
    app = web.Application(
        middlewares=[make_middleware(token, metrics_, cfg.max_request_bytes)], client_max_size=cfg.max_request_bytes
    )
    app[METRICS] = metrics_
    app[TOOLS] = tools
    app[STORE] = EpisodeStore(cfg, tools, metrics_, worker_index)
    app[OPENAPI] = dumps(openapi_document(list(tools), auth=bool(token), user=cfg.user is not None))
    app.router.add_post("/v1/episodes", create_episode)
    app.router.add_post("/v1/episodes/{episode_id}/step", step)
    app.router.add_get("/v1/episodes/{episode_id}", get_episode, allow_head=False)
    app.router.add_delete("/v1/episodes/{episode_id}", delete_episode)
    for path, handler in (
        ("/v1/tools", list_tools),
        ("/healthz", healthz),
        ("/metrics", metrics),
        ("/openapi.json", openapi),
    ):
        app.router.add_get(path, handler, allow_head=False)  # HEAD is not in the document: a 405 like any other

    async def lifecycle(app: web.Application):
        gc_task = asyncio.get_running_loop().create_task(app[STORE].run_gc())
        yield
        gc_task.cancel()
        for tool in tools.values():
            if hasattr(tool, "aclose"):
                await tool.aclose()
        await app[STORE].close()

    app.cleanup_ctx.append(lifecycle)
    return app


async def serve(
    cfg: ServiceConfig,
    host: str,
    port: int,
    *,
    token: str | None = None,
    worker_index: int = 0,
    ready_file: str | None = None,
    parent_pid: int | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, or until process ``parent_pid`` is gone when given; announces
    ``READY <url>`` on stdout once listening. An address it cannot listen on (a port in use) raises
    ``ListenError``, whose message says what to change."""
    app = build_app(cfg, token=token, worker_index=worker_index)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=75.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ListenError(listen_error(host, port, e)) from e
    bound_port = runner.addresses[0][1]
    _tune_gc()
    url = f"http://{_url_host(host)}:{bound_port}"
    print(f"READY {url}", flush=True)
    if ready_file:
        write_ready_file(ready_file, [url])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watch = loop.create_task(_stop_when_orphaned(parent_pid, stop)) if parent_pid else None
    await stop.wait()
    if watch is not None:
        watch.cancel()
    await runner.cleanup()


async def _stop_when_orphaned(parent_pid: int, stop: asyncio.Event, every_s: float = 0.5) -> None:
    while not stop.is_set():
        if parent_gone(parent_pid):
            log.warning("the process that started this service (pid %d) is gone: stopping", parent_pid)
            stop.set()
            return
        await asyncio.sleep(every_s)


def _tune_gc() -> None:
    """Keep the cyclic GC off the hot path: the start-up heap (modules, tool tables, corpora) is
    frozen out of collections, and young collections run 10x less often, so most per-request
    garbage is freed by reference counting before a collection ever sees it."""
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 7000), gen1, gen2)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools_env.server", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8700, help="first port; 0 picks free ports")
    p.add_argument("--config", default=None, help="service config, .yaml/.yml or .json")
    p.add_argument("--workers", type=int, default=1, help="independent worker processes, one port each")
    p.add_argument("--token", default=None, help="bearer token (default: env TOOLS_ENV_TOKEN)")
    p.add_argument("--ready-file", default=None, help="write {'urls': [...]} here once listening")
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this one exits, even by SIGKILL (launchers pass it)",
    )
    p.add_argument(
        "--orphan-cleanup",
        action="append",
        default=[],
        metavar="DIR",
        help="with --exit-with-parent: folders the starting process made for this service, removed when it is gone",
    )
    p.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.parent_pid = os.getppid() if args.exit_with_parent else None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = args.token or os.environ.get("TOOLS_ENV_TOKEN") or None
    if not is_loopback(args.host) and not token:
        print(
            f"error: refusing to bind {args.host} without a bearer token; pass --token or set TOOLS_ENV_TOKEN "
            "(only loopback addresses may run without one)",
            file=sys.stderr,
        )
        return 2
    if args.workers < 1:
        print("error: --workers must be >= 1", file=sys.stderr)
        return 2
    try:
        cfg = ServiceConfig.load(args.config)
        check_tool_sections(cfg)  # fail fast, before any worker starts
    except (OSError, ValueError) as e:
        print(f"error: bad config {args.config}: {e}", file=sys.stderr)
        return 2
    if args.workers > 1:
        from tools_env.supervisor import supervise_workers

        return supervise_workers(args, token)
    try:
        _run(
            serve(
                cfg,
                args.host,
                args.port,
                token=token,
                worker_index=args.worker_index,
                ready_file=args.ready_file,
                parent_pid=args.parent_pid,
            )
        )
    except ListenError as e:  # one line, not the event loop's traceback
        print(f"error: tools_env.server: {e}", file=sys.stderr)
        return 2
    remove_if_orphaned(args.parent_pid, args.orphan_cleanup)  # nobody is left to stop() this service
    return 0


class ListenError(OSError):
    """The service cannot listen on its address; the message says what to change."""


def listen_error(host: str, port: int, e: OSError) -> str:
    """What keeps the service from listening on ``host:port``, in words that say what to change."""
    if e.errno == errno.EADDRINUSE:
        return f"port {port} is in use on {host} (choose another with --port, or --port 0 for a free one)"
    if e.errno == errno.EACCES:
        return f"not allowed to listen on port {port} (ports below 1024 need privileges; choose another with --port)"
    if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(e, socket.gaierror):
        return f"cannot listen on {host}: no such address on this machine (check --host): {e.strerror or e}"
    return f"cannot listen on {host}:{port}: {e.strerror or e}"


def _run(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


if __name__ == "__main__":
    sys.exit(main())
