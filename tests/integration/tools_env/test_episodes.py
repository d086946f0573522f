"""The episode store in-process: guards, expiry, per-episode serialization, errors as observations."""

import asyncio
import os
import time

import pytest

from tools_env.service_config import ServiceConfig
from tools_env.episodes import EpisodeStore, ServiceError
from tools_env.prometheus import Metrics
from tools_env.tools.answer import Answer
from tools_env.tools.base import Tool, ToolResult
from tools_env.tools.calculator import Calculator
from tools_env_helpers import qa_task


class Priced(Tool):
    name = "priced"
    parameters = {"type": "object", "properties": {}, "required": []}

    async def call(self, arguments, ctx):
        return ToolResult(observation="ok", cost=0.4, latency_s=2.0)


class Slow(Tool):
    """Sleeps, and records whether two calls of one episode ever overlapped."""

    name = "slow"
    parameters = {"type": "object", "properties": {"s": {"type": "number"}}, "required": []}

    def __init__(self, config=None):
        super().__init__(config)
        self.inside, self.overlaps = 0, 0

    async def call(self, arguments, ctx):
        self.inside += 1
        self.overlaps += self.inside > 1
        await asyncio.sleep(arguments.get("s", 0.01))
        self.inside -= 1
        return ToolResult(observation="slept")


class Broken(Tool):
    name = "broken"

    async def call(self, arguments, ctx):
        raise RuntimeError("bug in the tool")


class Writer(Tool):
    name = "writer"

    async def call(self, arguments, ctx):
        os.makedirs(ctx.workdir, exist_ok=True)
        with open(os.path.join(ctx.workdir, "f.txt"), "w") as f:
            f.write("x")
        return ToolResult(observation=ctx.workdir)


def make_store(**guards):
    cfg = ServiceConfig.from_dict({"guards": guards})
    tools = {t.name: t for t in (Calculator(), Answer(), Priced(), Slow(), Broken(), Writer())}
    return EpisodeStore(cfg, tools, Metrics())


def run(coro):
    return asyncio.run(coro)


def test_max_turns_ends_the_episode_and_later_steps_are_refused():
    async def go():
        store = make_store(max_turns=3)
        ep, _ = store.create(qa_task(["calculator", "answer"]))
        r = [await store.step(ep.id, "calculator", {"expression": "1+1"}) for _ in range(3)]
        assert [x["done"] for x in r] == [False, False, True]
        assert r[2]["outcome"]["correct"] is False and "guard max_turns" in r[2]["outcome"]["reason"]
        with pytest.raises(ServiceError) as e:
            await store.step(ep.id, "answer", {"answer": "42"})
        assert (e.value.status, e.value.code) == (409, "episode_done")
        assert store.lookup(ep.id)["ended_by"] == "max_turns"

    run(go())


def test_answer_on_the_last_allowed_turn_is_still_verified():
    async def go():
        store = make_store(max_turns=2)
        ep, _ = store.create(qa_task(["calculator", "answer"]))
        await store.step(ep.id, "calculator", {"expression": "6*7"})
        r = await store.step(ep.id, "answer", {"answer": "42"})
        assert r["done"] and r["outcome"] == {"correct": True, "score": 1.0, "reason": "exact match"}

    run(go())


def test_max_cost_guard():
    async def go():
        store = make_store(max_cost=1.0)
        ep, _ = store.create(qa_task(["priced", "answer"]))
        r = [await store.step(ep.id, "priced", {}) for _ in range(3)]  # 0.4, 0.8, 1.2 > 1.0
        assert [x["done"] for x in r] == [False, False, True]
        assert "guard max_cost" in r[2]["outcome"]["reason"]
        s = store.lookup(ep.id)
        assert s["total_cost"] == pytest.approx(1.2) and s["total_latency_s"] == pytest.approx(6.0)

    run(go())


def test_max_wall_cuts_off_a_running_call():
    async def go():
        store = make_store(max_wall_s=0.3)
        ep, _ = store.create(qa_task(["slow", "answer"]))
        t0 = time.monotonic()
        r = await store.step(ep.id, "slow", {"s": 30})
        assert time.monotonic() - t0 < 2
        assert r["done"] and "cut off" in r["observation"] and "guard max_wall_s" in r["outcome"]["reason"]

    run(go())


def test_max_wall_already_past_ends_without_running_the_tool():
    async def go():
        store = make_store(max_wall_s=0.05)
        ep, _ = store.create(qa_task(["calculator", "answer"]))
        await asyncio.sleep(0.1)
        r = await store.step(ep.id, "calculator", {"expression": "1"})
        assert r["done"] and r["error"] == "guard: max_wall_s"
        assert store.lookup(ep.id)["turns"] == 0

    run(go())


def test_idle_episodes_expire_with_their_workdir():
    async def go():
        store = make_store(ttl_s=10)
        ep, _ = store.create(qa_task(["writer", "answer"]))
        workdir = (await store.step(ep.id, "writer", {}))["observation"]
        assert os.path.exists(os.path.join(workdir, "f.txt"))
        assert store.collect_garbage(time.monotonic() + 5) == 0
        assert store.collect_garbage(time.monotonic() + 11) == 1
        await store.close()
        assert not os.path.exists(workdir)
        assert store.lookup(ep.id)["status"] == "expired"
        with pytest.raises(ServiceError) as e:
            await store.step(ep.id, "writer", {})
        assert (e.value.status, e.value.code) == (410, "episode_expired")
        assert store.metrics.episodes_expired == 1

    run(go())


def test_concurrent_steps_on_one_episode_serialize():
    async def go():
        store = make_store(max_turns=100)
        ep, _ = store.create(qa_task(["slow", "answer"]))
        results = await asyncio.gather(*(store.step(ep.id, "slow", {"s": 0.005}) for _ in range(20)))
        assert all(r["observation"] == "slept" for r in results)
        assert store.tools["slow"].overlaps == 0
        assert store.lookup(ep.id)["turns"] == 20

    run(go())


def test_bad_calls_are_observations_and_count_as_turns():
    async def go():
        store = make_store()
        ep, _ = store.create(qa_task(["calculator", "answer"]))
        cases = [
            ("nope", {}),
            ("priced", {}),
            (None, {}),
            ("calculator", {"expr": "1"}),
            ("calculator", {"expression": 3}),
            ("calculator", "not json"),
            ("calculator", [1]),
        ]
        for name, args in cases:
            r = await store.step(ep.id, name, args)
            assert r["error"] and r["observation"].startswith("error:") and not r["done"]
        r = await store.step(ep.id, "calculator", '{"expression": "2*3"}')  # OpenAI-style string arguments
        assert r == {"observation": "6", "cost": 0.0, "latency_s": r["latency_s"], "done": False, "error": None}
        s = store.lookup(ep.id)
        assert (s["turns"], s["error_count"], s["tool_counts"]) == (8, 7, {"calculator": 5})
        assert store.metrics.tool_calls == {"_unknown": 2, "priced": 1, "calculator": 5}

    run(go())


def test_a_tool_that_raises_is_an_error_observation():
    async def go():
        store = make_store()
        ep, _ = store.create(qa_task(["broken", "answer"]))
        r = await store.step(ep.id, "broken", {})
        assert "internal tool error: RuntimeError: bug in the tool" in r["error"]
        assert (await store.step(ep.id, "answer", {"answer": "42"}))["outcome"]["correct"]

    run(go())


def test_delete_waits_for_a_running_step_then_the_episode_is_gone():
    async def go():
        store = make_store()
        ep, _ = store.create(qa_task(["slow", "answer"]))
        running = asyncio.ensure_future(store.step(ep.id, "slow", {"s": 0.1}))
        await asyncio.sleep(0.01)
        summary = await store.delete(ep.id)
        assert running.done() and running.result()["observation"] == "slept"
        assert summary["turns"] == 1
        with pytest.raises(ServiceError) as e:
            await store.step(ep.id, "slow", {})
        assert e.value.status == 404

    run(go())


@pytest.mark.parametrize(
    "record, code, words",
    [
        (qa_task(["calculator", "telepathy"]), "unknown_tool", "'telepathy'"),
        ({"problem": "p", "answer": "a", "tools": []}, "bad_task", "'category'"),
        (qa_task(["calculator", "calculator"]), "bad_task", "twice"),
        ([1, 2], "bad_task", "JSON object"),
        (qa_task(["answer"], prices={"x": {"input": -1}}), "bad_task", "prices.x.input"),
    ],
)
def test_bad_task_records(record, code, words):
    async def go():
        with pytest.raises(ServiceError) as e:
            make_store().create(record)
        assert (e.value.status, e.value.code) == (400, code) and words in e.value.message

    run(go())


def test_episode_ids_and_capacity():
    async def go():
        store = make_store(max_episodes=2)
        store.create(qa_task(["answer"]), "mine-1")
        with pytest.raises(ServiceError) as e:
            store.create(qa_task(["answer"]), "mine-1")
        assert e.value.code == "episode_exists"
        for bad in ("../etc", "a/b", "", ".hidden", "x" * 65):
            with pytest.raises(ServiceError) as e:
                store.create(qa_task(["answer"]), bad)
            assert e.value.code == "bad_episode_id"
        assert store.create(qa_task(["answer"]))[0].id.startswith("w0-")
        with pytest.raises(ServiceError) as e:
            store.create(qa_task(["answer"]))
        assert (e.value.status, e.value.code) == (503, "too_many_episodes")

    run(go())


def test_a_task_with_an_unregistered_verifier_type_is_refused_at_creation():
    store = make_store()
    with pytest.raises(ServiceError) as e:
        store.create(qa_task(["answer"], verifier={"type": "vibes"}))
    assert (e.value.status, e.value.code) == (400, "unknown_verifier") and "'vibes' is not registered" in str(e.value)
