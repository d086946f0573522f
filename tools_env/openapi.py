"""The OpenAPI 3.0 document of the service, built from the schemas the handlers validate with.

``openapi_document(tool_names, auth)`` lists every route with every status it can answer: the
structured errors of ``server.py``'s middleware (400, 404, 409, 410, 413, 503 where the route
has them; 500 ``internal`` everywhere, the last resort for a bug), and 401 on every route but
``/healthz`` and ``/openapi.json`` when the service runs with a token. The bearer scheme is
declared only then: a service without a token declares no security, so no client thinks it
needs an ``Authorization`` header. ``/healthz`` and ``/openapi.json`` are readable without a
token (liveness probes and contract readers hold none; neither reveals an episode).
"""

from __future__ import annotations

from typing import Any

from tools_env import schema as S
from tools_env.verify import USER_REQUIRED, VERIFIERS

NO_AUTH_PATHS = frozenset({"/healthz", "/openapi.json"})
_COMPONENTS = {
    "StepRequest": S.STEP_REQUEST,
    "StepResponse": S.STEP_RESPONSE,
    "Outcome": S.OUTCOME,
    "EpisodeSummary": S.EPISODE_SUMMARY,
    "EpisodeDeleted": S.EPISODE_DELETED,
    "EpisodeCreated": S.EPISODE_CREATED,
    "ToolList": S.TOOL_LIST,
    "Health": S.HEALTH,
    "Error": S.ERROR,
}
_WHY = {
    400: "bad input (the message names the field)",
    401: "missing or wrong bearer token",
    404: "no such episode",
    409: "the episode exists already, or is done",
    410: "the episode expired",
    413: "body over max_request_bytes",
    500: "a bug in the service (logged)",
    503: "guards.max_episodes live episodes in this process",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _op(
    op_id: str,
    summary: str,
    ok: dict[str, Any],
    errors: tuple[int, ...],
    auth: bool,
    path: str,
    *,
    body: str | None = None,
    params: list[dict[str, Any]] = (),
    links: dict | None = None,
) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    if links:
        responses["200"]["links"] = links
    needs_token = auth and path not in NO_AUTH_PATHS
    for status in sorted({*errors, 500} | ({401} if needs_token else set())):
        responses[str(status)] = {"description": _WHY[status], "content": _json(_ref("Error"))}
    if needs_token:
        responses["401"]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string", "enum": ["Bearer"]}}}
    op: dict[str, Any] = {"operationId": op_id, "summary": summary, "responses": responses}
    if params:
        op["parameters"] = list(params)
    if body:
        op["requestBody"] = {"required": True, "content": _json(_ref(body))}
    if auth and path in NO_AUTH_PATHS:
        op["security"] = []
    return op


def _episode_links() -> dict[str, Any]:
    eid = {"episode_id": "$response.body#/episode_id"}
    return {
        name: {"operationId": op, "parameters": eid}
        for name, op in (("Step", "step"), ("GetEpisode", "getEpisode"), ("DeleteEpisode", "deleteEpisode"))
    }


def _paths(auth: bool) -> dict[str, Any]:
    in_path = {"name": "episode_id", "in": "path", "required": True, "schema": {"type": "string"}}
    in_query = {
        "name": "episode_id",
        "in": "query",
        "required": False,
        "description": "the id to give the episode (clients route by it); default: w<worker>-<16 hex>",
        "schema": {"type": "string", "pattern": S.EPISODE_ID_PATTERN},
    }
    eid = "/v1/episodes/{episode_id}"
    return {
        "/v1/episodes": {
            "post": _op(
                "createEpisode",
                "create an episode from a task record",
                _json(_ref("EpisodeCreated")),
                (400, 409, 413, 503),
                auth,
                "/v1/episodes",
                body="TaskRecord",
                params=[in_query],
                links=_episode_links(),
            )
        },
        eid + "/step": {
            "post": _op(
                "step",
                "call a tool; a bad call is a 200 with `error` set",
                _json(_ref("StepResponse")),
                (400, 404, 409, 410, 413),
                auth,
                eid + "/step",
                body="StepRequest",
                params=[in_path],
            )
        },
        eid: {
            "get": _op(
                "getEpisode",
                "episode status and totals",
                _json(_ref("EpisodeSummary")),
                (404,),
                auth,
                eid,
                params=[in_path],
            ),
            "delete": _op(
                "deleteEpisode",
                "drop an episode and its workdir",
                _json(_ref("EpisodeDeleted")),
                (404,),
                auth,
                eid,
                params=[in_path],
            ),
        },
        "/v1/tools": {
            "get": _op(
                "listTools", "schemas of every tool of the service", _json(_ref("ToolList")), (), auth, "/v1/tools"
            )
        },
        "/healthz": {"get": _op("healthz", "liveness (no token needed)", _json(_ref("Health")), (), auth, "/healthz")},
        "/metrics": {
            "get": _op(
                "metrics",
                "Prometheus text format",
                {"text/plain": {"schema": {"type": "string"}}},
                (),
                auth,
                "/metrics",
            )
        },
        "/openapi.json": {
            "get": _op(
                "openapi", "this document (no token needed)", _json({"type": "object"}), (), auth, "/openapi.json"
            )
        },
    }


def openapi_document(tool_names: list[str], auth: bool, user: bool = False) -> dict[str, Any]:
    """The document a service with these tools (and a token, when ``auth``) serves at ``/openapi.json``.
    Verifier types whose tasks need a simulated user are listed only when the service has one (``user``)."""
    kinds = sorted(k for k in VERIFIERS if user or k not in USER_REQUIRED)
    components: dict[str, Any] = {"schemas": {"TaskRecord": S.task_record_schema(tool_names, kinds), **_COMPONENTS}}
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": "nemo-orchestra tool environment", "version": "1"},
        "servers": [{"url": "/"}],
        "paths": _paths(auth),
        "components": components,
    }
    if auth:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
