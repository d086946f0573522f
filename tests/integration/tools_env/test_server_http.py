"""The service over real HTTP (a subprocess from launch.py): every endpoint's bad inputs are
structured 4xx errors, bad tool calls are 200 observations, and many episodes run at once."""

import asyncio
import json

import pytest

from tools_env.client import ToolsEnvClient, ToolsEnvError
from tools_env.supervisor import start_service
from tools_env_helpers import http, qa_task, run

CONFIG = {"max_request_bytes": 65536, "guards": {"max_cost": 0.012}}


@pytest.fixture(scope="module")
def svc():
    with start_service(CONFIG) as handle:
        yield handle


@pytest.fixture
def url(svc):
    return svc.urls[0]


def new_episode(url, tools=("calculator", "expert", "answer"), **kw):
    status, body = http(f"{url}/v1/episodes", "POST", qa_task(list(tools), **kw))
    assert status == 200, body
    return body["episode_id"], body["tools"]


def assert_error(status_body, status, code, words=""):
    got_status, body = status_body
    assert got_status == status, body
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    assert body["error"]["code"] == code, body
    assert words in body["error"]["message"], body


def test_create_returns_the_subset_schemas_in_record_order(url):
    _, tools = new_episode(url, ("answer", "calculator"))
    assert [t["function"]["name"] for t in tools] == ["answer", "calculator"]
    assert tools[1]["function"]["parameters"]["required"] == ["expression"]


def test_create_bad_inputs(url):
    assert_error(http(f"{url}/v1/episodes", "POST", raw=b"{not json"), 400, "bad_json")
    assert_error(http(f"{url}/v1/episodes", "POST", raw=b""), 400, "bad_json")
    assert_error(http(f"{url}/v1/episodes", "POST", [1, 2]), 400, "bad_task", "JSON object")
    assert_error(
        http(f"{url}/v1/episodes", "POST", {"problem": "p", "answer": "a", "tools": []}), 400, "bad_task", "'category'"
    )
    assert_error(
        http(f"{url}/v1/episodes", "POST", qa_task(["calculator", "telepathy"])), 400, "unknown_tool", "'telepathy'"
    )
    assert_error(http(f"{url}/v1/episodes", "POST", qa_task(["answer"], extra_field=1)), 400, "bad_task", "extra_field")
    assert_error(
        http(f"{url}/v1/episodes", "POST", qa_task(["answer"], problem="x" * 70000)), 413, "payload_too_large", "65536"
    )
    assert_error(http(f"{url}/v1/episodes?episode_id=a/b", "POST", qa_task(["answer"])), 400, "bad_episode_id")
    assert http(f"{url}/v1/episodes?episode_id=dup-1", "POST", qa_task(["answer"]))[0] == 200
    assert_error(http(f"{url}/v1/episodes?episode_id=dup-1", "POST", qa_task(["answer"])), 409, "episode_exists")
    assert_error(http(f"{url}/v1/episodes", "GET"), 405, "method_not_allowed")


def test_step_bad_inputs(url):
    eid, _ = new_episode(url)
    step = f"{url}/v1/episodes/{eid}/step"
    assert_error(
        http(f"{url}/v1/episodes/nope/step", "POST", {"name": "answer", "arguments": {}}),
        404,
        "episode_not_found",
        "'nope'",
    )
    assert_error(http(step, "POST", raw=b'{"name": "calculator", '), 400, "bad_json")
    assert_error(http(step, "POST", raw=b"\xff\xfe"), 400, "bad_json")
    assert_error(http(step, "POST", ["calculator"]), 400, "bad_request")
    assert_error(http(step, "POST", {"name": "calculator", "arguments": {}, "id": 3}), 400, "bad_request", "id")
    assert_error(
        http(step, "POST", {"name": "calculator", "arguments": {"expression": "1" * 70000}}), 413, "payload_too_large"
    )
    assert_error(http(step, "GET"), 405, "method_not_allowed")
    # none of the above was a turn
    assert http(f"{url}/v1/episodes/{eid}")[1]["turns"] == 0


def test_bad_tool_calls_are_observations(url):
    eid, _ = new_episode(url)
    step = f"{url}/v1/episodes/{eid}/step"
    for body in (
        {"name": "python", "arguments": {"code": "1"}},
        {"name": "calculator", "arguments": {"x": 1}},
        {"name": "calculator", "arguments": {"expression": 5}},
        {"name": 7, "arguments": {}},
        {"arguments": {}},
        {"name": "calculator", "arguments": "[]"},
        {"name": "expert", "arguments": {"model": "gpt-7", "query": "q"}},
        {"name": "calculator", "arguments": {"expression": "1/0"}},
    ):
        status, r = http(step, "POST", body)
        assert status == 200 and r["error"] and not r["done"], (body, r)
        assert set(r) == {"observation", "cost", "latency_s", "done", "error"}
    s = http(f"{url}/v1/episodes/{eid}")[1]
    assert (s["status"], s["turns"], s["error_count"]) == ("active", 8, 8)
    assert s["tool_counts"] == {"calculator": 4, "expert": 1}


def test_full_episode_then_finished_and_deleted(url):
    eid, _ = new_episode(url)
    step = f"{url}/v1/episodes/{eid}/step"
    assert http(step, "POST", {"name": "calculator", "arguments": {"expression": "6*7"}})[1]["observation"] == "42"
    status, r = http(step, "POST", {"name": "answer", "arguments": {"answer": "42"}})
    assert status == 200 and r["done"] and r["outcome"] == {"correct": True, "score": 1.0, "reason": "exact match"}
    assert_error(http(step, "POST", {"name": "answer", "arguments": {"answer": "42"}}), 409, "episode_done")
    s = http(f"{url}/v1/episodes/{eid}")[1]
    assert (s["status"], s["turns"], s["ended_by"], s["outcome"]["correct"]) == ("done", 2, "answer", True)
    assert http(f"{url}/v1/episodes/{eid}", "DELETE")[1]["deleted"] is True
    assert_error(http(f"{url}/v1/episodes/{eid}"), 404, "episode_not_found")
    assert_error(http(f"{url}/v1/episodes/{eid}", "DELETE"), 404, "episode_not_found")
    assert_error(http(step, "POST", {"name": "answer", "arguments": {"answer": "42"}}), 404, "episode_not_found")


def test_cost_guard_over_http(url):
    eid, _ = new_episode(url)
    call = {"name": "expert", "arguments": {"model": "expert-large", "query": "what is 6 * 7?"}}
    done = [http(f"{url}/v1/episodes/{eid}/step", "POST", call)[1]["done"] for _ in range(3)]
    assert done == [False, False, True]  # $0.0052525 a call; the limit is $0.012
    s = http(f"{url}/v1/episodes/{eid}")[1]
    assert s["ended_by"] == "max_cost" and "guard max_cost" in s["outcome"]["reason"]
    assert s["model_counts"] == {"expert-large": 3}


def test_simulated_expert_cost_prices_and_reproducibility(url):
    call = {"name": "expert", "arguments": {"model": "expert-large", "query": "what is 6*7"}}  # 11 chars
    a, _ = new_episode(url, tag="repro")
    b, _ = new_episode(url, tag="repro")  # same problem, so the same task id
    ra = http(f"{url}/v1/episodes/{a}/step", "POST", call)[1]
    rb = http(f"{url}/v1/episodes/{b}/step", "POST", call)[1]
    assert ra["observation"] == rb["observation"] and ra["latency_s"] == rb["latency_s"]
    assert ra["observation"].startswith("expert-large: The answer is ")
    assert ra["cost"] == pytest.approx(((11 // 4 + 200) * 1.25 + 500 * 10.0) / 1e6)
    assert 8.0 <= ra["latency_s"] <= 10.0
    c, tools = new_episode(url, prices={"expert-large": {"input": 0, "output": 1}})
    assert "| expert-large (simulated) | 0 | 1 |" in tools[1]["function"]["description"]
    assert http(f"{url}/v1/episodes/{c}/step", "POST", call)[1]["cost"] == pytest.approx(500 / 1e6)


def test_info_endpoints(url):
    status, spec = http(f"{url}/openapi.json")
    assert status == 200 and spec["openapi"].startswith("3.")
    assert {
        "/v1/episodes",
        "/v1/episodes/{episode_id}/step",
        "/v1/episodes/{episode_id}",
        "/v1/tools",
        "/healthz",
        "/metrics",
    } <= set(spec["paths"])
    names = {t["function"]["name"] for t in http(f"{url}/v1/tools")[1]["tools"]}
    assert {"calculator", "python", "expert", "answer"} <= names
    assert http(f"{url}/healthz")[1]["status"] == "ok"
    assert_error(http(f"{url}/no/such/path"), 404, "not_found")
    for path, method in (
        ("/v1/tools", "PUT"),
        ("/healthz", "POST"),
        ("/metrics", "DELETE"),
        ("/openapi.json", "POST"),
        ("/v1/episodes/x", "PUT"),
        ("/v1/episodes/x/step", "DELETE"),
    ):
        assert_error(http(f"{url}{path}", method, {}), 405, "method_not_allowed")
    status, text = http(f"{url}/metrics")
    assert status == 200 and "# TYPE tools_env_tool_calls_total counter" in text
    assert 'tools_env_http_errors_total{code="bad_json"}' in text
    assert 'tools_env_tool_calls_total{tool="_unknown"}' in text or "tools_env_tool_calls_total" in text


def test_concurrent_steps_on_one_episode_serialize_under_the_turn_guard(url):
    eid, _ = new_episode(url)

    async def go():
        async with ToolsEnvClient([url]) as client:
            return await asyncio.gather(
                *(client.step(eid, "calculator", {"expression": "1+1"}) for _ in range(40)), return_exceptions=True
            )

    results = run(go())
    ok = [r for r in results if isinstance(r, dict)]
    refused = [r for r in results if isinstance(r, ToolsEnvError)]
    assert len(ok) == 30 and len(refused) == 10  # max_turns 30: exactly 30 turns ran
    assert sum(r["done"] for r in ok) == 1 and all(e.code == "episode_done" for e in refused)
    assert http(f"{url}/v1/episodes/{eid}")[1]["turns"] == 30


def test_512_concurrent_episodes(svc):
    async def episode(client, i):
        created = await client.create_episode(qa_task(["calculator", "answer"], answer=str(i * 7), tag=str(i)))
        eid = created["episode_id"]
        r = await client.step(eid, "calculator", {"expression": f"{i} * 7"})
        final = await client.step(eid, "answer", {"answer": r["observation"] if i % 2 == 0 else "wrong"})
        summary = await client.get_episode(eid)
        await client.delete_episode(eid)
        return final["outcome"]["correct"], summary["turns"]

    async def go():
        async with ToolsEnvClient(svc.urls) as client:
            return await asyncio.gather(*(episode(client, i) for i in range(512)))

    results = run(go())
    assert [c for c, _ in results] == [i % 2 == 0 for i in range(512)]
    assert all(turns == 2 for _, turns in results)
    assert http(f"{svc.urls[0]}/healthz")[1]["episodes"] < 512  # deleted ones are gone


def test_client_raises_tools_env_error_with_the_server_message(url):
    async def go():
        async with ToolsEnvClient([url]) as client:
            with pytest.raises(ToolsEnvError) as e:
                await client.create_episode(qa_task(["telepathy"]))
            assert (e.value.status, e.value.code) == (400, "unknown_tool") and "telepathy" in e.value.message
            with pytest.raises(ToolsEnvError) as e:
                await client.step("missing", "answer", {"answer": "x"})
            assert e.value.status == 404
        async with ToolsEnvClient(["http://127.0.0.1:9"]) as dead:  # nothing listens on the discard port
            with pytest.raises(ToolsEnvError) as e:
                await dead.get_episode("x")
            assert (e.value.status, e.value.code) == (0, "connection_error")

    run(go())


def test_openapi_is_valid_json_served_as_json(url):
    status, spec = http(f"{url}/openapi.json")
    assert json.loads(json.dumps(spec))["info"]["version"] == "1"
