"""Faults a long run meets, each with a bounded outcome: the tool service dying mid-batch (restarted
and the batch redone, or a one-line stop within 60 s), an expert endpoint that accepts connections
and never answers (an error observation at its timeout while other episodes go on), and a task
file with a malformed line (one line naming the file, the line and the field)."""

import asyncio
import json
import os
import signal
import socket
import threading
import time

import pytest

from tools_env.client import ToolsEnvClient, ToolsEnvError
from tools_env.supervisor import start_service
from tools_env.recovery import ToolServiceDown, tool_service_context, with_tool_service
from tools_env.task import TaskRecordError, load_jsonl
from tools_env_helpers import http, qa_task


def kill(handle):
    os.killpg(handle.process.pid, signal.SIGKILL)
    handle.process.wait(10)


def batch(client, loop, kill_before_steps=None, n=8):
    """n episodes of calculator then answer; ``kill_before_steps(attempt)`` may kill the service once
    the episodes exist, before their steps."""
    attempts = []

    async def play(i, eid):
        r = await client.step(eid, "calculator", {"expression": f"6*{i}"})
        return (await client.step(eid, "answer", {"answer": r["observation"]}))["outcome"]["correct"]

    async def run_all():
        attempts.append(len(attempts) + 1)
        created = await asyncio.gather(
            *(client.create_episode(qa_task(["calculator", "answer"], answer=str(6 * i), tag=str(i))) for i in range(n))
        )
        if kill_before_steps:
            kill_before_steps(len(attempts))
        return await asyncio.gather(*(play(i, c["episode_id"]) for i, c in enumerate(created)))

    return lambda: loop.run_until_complete(run_all()), attempts


def test_a_dead_service_it_started_is_restarted_and_the_batch_redone():
    loop = asyncio.new_event_loop()
    with start_service() as svc:
        client = ToolsEnvClient(svc.urls, service=svc)
        first_urls, first_pid = list(svc.urls), svc.process.pid
        fn, attempts = batch(client, loop, lambda attempt: kill(svc) if attempt == 1 else None)
        t0 = time.monotonic()
        results = with_tool_service(fn, client, **tool_service_context("runs/x", 4))
        assert time.monotonic() - t0 < 60
        assert results == [True] * 8 and attempts == [1, 2] and svc.restarts == 1
        assert client.urls == svc.urls != first_urls and svc.alive()
        with pytest.raises(ProcessLookupError):
            os.killpg(first_pid, 0)
        assert http(f"{svc.urls[0]}/healthz")[1]["status"] == "ok"
        loop.run_until_complete(client.aclose())
    loop.close()


def test_a_dead_service_not_started_here_stops_the_run_in_one_line():
    loop = asyncio.new_event_loop()
    with start_service() as svc:
        client = ToolsEnvClient(svc.urls)  # given by URL: not ours to restart
        fn, attempts = batch(client, loop, lambda attempt: kill(svc))
        t0 = time.monotonic()
        with pytest.raises(ToolServiceDown) as e:
            with_tool_service(fn, client, **tool_service_context("runs/x", 4))
        assert time.monotonic() - t0 < 60 and attempts == [1]
        line = str(e.value)
        assert "\n" not in line and line.startswith(f"error: tool service {svc.urls[0]} stopped answering")
        assert "step 5's rollouts" in line and "resumes from the newest checkpoint in runs/x/checkpoints" in line
        loop.run_until_complete(client.aclose())
    loop.close()


def test_a_service_that_dies_again_after_its_restart_stops_the_run():
    loop = asyncio.new_event_loop()
    with start_service() as svc:
        client = ToolsEnvClient(svc.urls, service=svc)
        fn, attempts = batch(client, loop, lambda attempt: kill(svc))
        with pytest.raises(ToolServiceDown, match=r"stopped answering again after 1 restart\(s\)"):
            with_tool_service(fn, client, **tool_service_context("runs/x", 0))
        assert attempts == [1, 2]
        loop.run_until_complete(client.aclose())
    loop.close()


def test_http_errors_are_not_mistaken_for_a_dead_service():
    loop = asyncio.new_event_loop()
    with start_service() as svc:
        client = ToolsEnvClient(svc.urls, service=svc)
        with pytest.raises(ToolsEnvError) as e:
            with_tool_service(
                lambda: loop.run_until_complete(client.get_episode("nope")), client, **tool_service_context("runs/x", 0)
            )
        assert e.value.status == 404 and svc.restarts == 0
        loop.run_until_complete(client.aclose())
    loop.close()


@pytest.fixture
def silent_endpoint():
    """A loopback port that accepts connections (the kernel completes the handshake) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held, stop = [], threading.Event()

    def accept():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])  # read nothing, answer nothing
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    stop.set()
    thread.join(5)
    for c in held:
        c.close()
    sock.close()


def test_an_expert_that_never_answers_ends_at_its_timeout_while_other_episodes_go_on(silent_endpoint):
    config = {
        "experts": {
            "endpoints": {
                "mute": {
                    "base_url": silent_endpoint,
                    "model": "m",
                    "price_in": 1,
                    "price_out": 1,
                    "timeout_s": 3.0,
                    "max_retries": 5,
                }
            }
        }
    }
    with start_service(config) as svc:

        async def go():
            async with ToolsEnvClient(svc.urls) as client:
                mute = (await client.create_episode(qa_task(["expert", "answer"], tag="mute")))["episode_id"]
                others = [
                    (await client.create_episode(qa_task(["calculator"], tag=str(i))))["episode_id"] for i in range(20)
                ]
                t0 = time.monotonic()
                hanging = asyncio.ensure_future(client.step(mute, "expert", {"model": "mute", "query": "hello?"}))
                await asyncio.sleep(0.2)  # the expert call is under way
                for eid in others:  # one after another, while the expert call hangs
                    r = await client.step(eid, "calculator", {"expression": "6*7"})
                    assert r["observation"] == "42"
                others_done = hanging.done()
                return await hanging, time.monotonic() - t0, others_done

        r, elapsed, others_done = asyncio.run(go())
    assert not others_done  # the 20 calculator calls finished before the silent expert's deadline
    assert r["error"] and "mute" in r["error"] and "3s deadline" in r["observation"] and not r["done"]
    assert 2.5 <= r["latency_s"] < 30 and elapsed < 30


def test_a_malformed_task_file_names_the_file_the_line_and_the_field(tmp_path):
    good = json.dumps(qa_task(["calculator"]))
    cases = {
        "missing.jsonl": (
            [good, json.dumps({k: v for k, v in qa_task(["calculator"]).items() if k != "category"})],
            ":2: task record is missing 'category'",
        ),
        "typed.jsonl": (
            [good, "", json.dumps(qa_task(["calculator"], prices={"x": {"input": "cheap"}}))],
            ":3: task record field 'prices.x.input' must be a number >= 0, got a string",
        ),
        "broken.jsonl": ([good, '{"problem": "p",'], ":2: not valid JSON"),
    }
    for name, (lines, words) in cases.items():
        path = tmp_path / name
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(TaskRecordError) as e:
            load_jsonl(str(path))
        assert str(e.value).startswith(f"{path}:") and words in str(e.value) and "\n" not in str(e.value)
