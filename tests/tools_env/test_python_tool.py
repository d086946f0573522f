"""The `python` tool through the service: output, errors, per-episode files, timeouts, cost."""

import importlib.util

import pytest

from tools_env.launch import start_service
from tools_env_helpers import http, qa_task

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tools_env.sandbox") is None,
                                reason="tools_env.sandbox is not importable yet")


@pytest.fixture(scope="module")
def url():
    with start_service({"python": {"wall_time_s": 2.0, "cpu_time_s": 2.0}}) as svc:
        yield svc.urls[0]


def episode(url):
    status, body = http(f"{url}/v1/episodes", "POST", qa_task(["python", "answer"]))
    assert status == 200, body
    return body["episode_id"]


def py(url, eid, code):
    status, r = http(f"{url}/v1/episodes/{eid}/step", "POST", {"name": "python", "arguments": {"code": code}},
                     timeout=30)
    assert status == 200, r
    return r


def test_prints_and_costs_by_the_second(url):
    r = py(url, episode(url), "print(sum(range(1000)))")
    assert r["observation"] == "499500" and r["error"] is None
    assert r["latency_s"] > 0 and r["cost"] == pytest.approx(r["latency_s"] * 0.0000083)


def test_an_exception_is_an_observation_not_a_tool_error(url):
    r = py(url, episode(url), "raise ValueError('boom')")
    assert "ValueError: boom" in r["observation"] and "[exit code 1]" in r["observation"]
    assert r["error"] is None and not r["done"]


def test_files_persist_within_an_episode_and_not_across(url):
    a, b = episode(url), episode(url)
    assert py(url, a, "open('notes.txt', 'w').write('kept')")["error"] is None
    assert py(url, a, "print(open('notes.txt').read())")["observation"] == "kept"
    assert "FileNotFoundError" in py(url, b, "print(open('notes.txt').read())")["observation"]


def test_a_runaway_program_times_out(url):
    r = py(url, episode(url), "while True:\n    pass")
    assert r["error"] and "timed out" in r["error"] and "[timed out]" in r["observation"]
    assert r["latency_s"] < 10


def test_bad_arguments_are_observations(url):
    eid = episode(url)
    status, r = http(f"{url}/v1/episodes/{eid}/step", "POST", {"name": "python", "arguments": {"source": "1"}})
    assert status == 200 and "missing argument 'code'" in r["error"]
